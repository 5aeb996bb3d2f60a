"""Left padding of a ``generate()`` batch: ``input_ids`` + ``attention_mask`` -> each row's own prompt."""

import torch


def left_padding(attention_mask: torch.Tensor | None, num_rows: int | None = None) -> list[int]:
    """Padding positions (tokens) at the start of each row of a left-padded batch.

    Args:
        attention_mask: ``[batch, seq_len]`` of 0/1 (any integer or bool dtype, any device), the zeros on the
            left; None: no padding (then ``num_rows`` zeros).
        num_rows: the batch size, used only when ``attention_mask`` is None.

    Returns:
        ``[batch]`` leading zeros per row; a row of all zeros has ``seq_len``.

    Raises:
        ValueError: a mask that is not 2-D, or rows with a 0 after a 1 (right or inner padding; rows named).

    Examples:
        >>> import torch
        >>> from paged_transformers.integration.padding import left_padding
        >>> left_padding(torch.tensor([[0, 0, 1], [1, 1, 1]]))
        [2, 0]
    """
    if attention_mask is None:
        return [0] * (num_rows or 0)
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, prompt_len], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.to("cpu", torch.int64)
    pad_lens = (mask.cumsum(dim=-1) == 0).sum(dim=-1)  # leading zeros per row
    bad = (pad_lens + mask.sum(dim=-1) != mask.shape[1]).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"attention_mask is not left padding: rows {bad[:5]} have a 0 after a 1")
    return pad_lens.tolist()


def unpadded_prompts(input_ids: torch.Tensor, pad_lens: list[int]) -> list[list[int]]:
    """Each row's prompt token ids without its left padding.

    Args:
        input_ids: ``[batch, seq_len]`` int64 token ids.
        pad_lens: ``[batch]`` padding positions per row (``left_padding``).
    """
    rows = input_ids.tolist()
    return [row[pad:] for row, pad in zip(rows, pad_lens)]
