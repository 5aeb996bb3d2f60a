"""The report of ``paged-transformers bench``: one engine's JSON entry, versions, device, the side-by-side
ratios and the text table printed last."""

import platform

import numpy as np
import torch

from .engines import EngineResult


def _dist(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.array(values)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(result: EngineResult) -> dict:
    """The JSON entry of one engine: throughputs, TTFT/TPOT distributions (s), peak memory (GiB), extras."""
    out = {
        "num_requests": result.num_requests,
        "elapsed_s": result.elapsed_s,
        "requests_per_s": result.num_requests / result.elapsed_s,
        "output_tokens": result.num_output_tokens,
        "output_tokens_per_s": result.num_output_tokens / result.elapsed_s,
        "total_tokens_per_s": (result.num_output_tokens + result.num_prompt_tokens) / result.elapsed_s,
        "ttft_s": _dist(result.ttft_s),
        "tpot_s": _dist(result.tpot_s),
        "peak_memory_gib": result.peak_memory_bytes / 2**30 if result.peak_memory_bytes is not None else None,
    }
    out.update(result.extra)
    return out


def versions() -> dict:
    import transformers

    from .. import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"paged_transformers": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": triton_version, "cuda": torch.version.cuda, "python": platform.python_version()}


def device_info(device) -> dict:
    device = torch.device(device)
    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine()}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "total_memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count}


def ratios(engines: dict) -> dict:
    """``paged_vs_<engine>``: output tokens/s of paged over the other's, side by side (same process)."""
    base = engines.get("paged")
    if not base:
        return {}
    return {f"paged_vs_{name}": {"output_tokens_per_s": base["output_tokens_per_s"] / e["output_tokens_per_s"],
                                 "paged_num_requests": base["num_requests"], "other_num_requests": e["num_requests"]}
            for name, e in engines.items() if name != "paged" and e.get("output_tokens_per_s")}


def format_table(report: dict) -> str:
    """The short text table printed last."""
    def ms(d):
        return "-" if d["mean"] is None else f"{d['mean']*1e3:.0f}/{d['p50']*1e3:.0f}/{d['p99']*1e3:.0f}"

    lines = [f"{'engine':<12} {'reqs':>5} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
             f"{'TTFT ms mean/p50/p99':>22} {'TPOT ms mean/p50/p99':>22} {'peak GiB':>8}"]
    for name, e in report["engines"].items():
        if "error" in e:
            lines.append(f"{name:<12} error: {e['error'][:100]}")
            continue
        peak = "-" if e["peak_memory_gib"] is None else f"{e['peak_memory_gib']:.1f}"
        lines.append(f"{name:<12} {e['num_requests']:>5} {e['requests_per_s']:>7.2f} {e['output_tokens_per_s']:>10.1f} "
                     f"{e['total_tokens_per_s']:>10.1f} {ms(e['ttft_s']):>22} {ms(e['tpot_s']):>22} {peak:>8}")
    for name, r in report.get("ratios", {}).items():
        lines.append(f"{name}: {r['output_tokens_per_s']:.2f}x output tok/s "
                     f"(paged on {r['paged_num_requests']} requests, other on {r['other_num_requests']})")
    roof = report.get("roofline") or {}
    if roof.get("output_tokens_per_s"):
        lines.append(f"roofline: {roof['output_tokens_per_s']:.0f} output tok/s; paged reaches "
                     f"{roof.get('paged_fraction', 0) * 100:.1f}%")
    paged = report["engines"].get("paged", {})
    if "kv_blocks_total" in paged:
        lines.append(f"KV: {paged['kv_blocks_used']}/{paged['kv_blocks_total']} blocks used at peak, capacity "
                     f"{paged['kv_capacity_tokens']} tokens; prefix-cache hit rate {paged['prefix_cache_hit_rate']}")
    if paged.get("graphs_captured"):
        lines.append(f"CUDA graphs: {paged['graphs_captured']} decode buckets captured before the timed run, in "
                     f"{paged['graph_capture_s']:.2f} s")
    so = paged.get("step_overhead", {})
    if so.get("available"):
        lines.append(f"GPU idle: {so['idle_fraction'] * 100:.1f}% of step wall time; " + "; ".join(
            f"{k} steps {v['num_steps']}: wall {v['wall_ms_mean']:.2f} ms, device {v['device_ms_mean']:.2f} ms, "
            f"idle {v['idle_ms_mean']:.2f} ms" for k, v in so.items() if isinstance(v, dict)))
    b1 = report.get("decode_batch1")
    if b1:
        lines.append(f"batch-1 decode (context {b1['context']}): {b1['tpot_s_p50'] * 1e3:.2f} ms/token "
                     f"(device {b1['device_s_p50'] * 1e3:.2f}); bound weights/copy-bw {b1['bound_s'] * 1e3:.2f} ms "
                     f"-> {b1['ratio_to_bound']:.2f}x")
    return "\n".join(lines)
