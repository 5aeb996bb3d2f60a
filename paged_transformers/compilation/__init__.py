"""What makes the unmodified transformers model fast inside the engine, behind one apply / restore object
(``Compilation``, owned by the engine's runner):

    layers.py        torch.compile of the decoder layers (split at the paged attention), the rotary embedding, the
                     norm and the LM head; the torch settings they are traced under
    fusion.py        q|k|v and gate|up as one GEMM each over a concatenated weight, inside the compiled layers
    gemv_routing.py  an Inductor pass: the compiled projections' batch-1 products on the Triton GEMV
    cuda_graphs.py   decode steps replayed from CUDA graphs, one per batch-size bucket, captured lazily
    compilation.py   ``Compilation``: all of the above for one model, ``apply`` / ``restore`` / ``undo``
"""

from .compilation import Compilation, fused_layers_unsupported
from .cuda_graphs import DecodeGraphs, graph_batch_sizes

__all__ = ["Compilation", "DecodeGraphs", "fused_layers_unsupported", "graph_batch_sizes"]
