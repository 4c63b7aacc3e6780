"""Token tensors between ragged samples and padded batches (pure torch, no model).

A sample's tokens travel between stages as 1-D tensors of their own length (``prompt_ids``,
``response_ids``, ``logprobs``), never padded per call: padding depends on which samples share
a call, and a field whose type or width changed with the shard boundaries would reach a
trainer as a tensor in one step and a list in the next. A step pads what it computes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence


class Padded(NamedTuple):
    """Prompt and response of each row, concatenated and right-padded to one width.

    ``response_mask[i, t]`` is 1 where token ``t`` of row ``i`` is a response token.
    """

    input_ids: torch.Tensor  # [n, T]
    attention_mask: torch.Tensor  # [n, T]
    response_mask: torch.Tensor  # [n, T]
    response_lengths: torch.Tensor  # [n]
    prompt_lengths: torch.Tensor  # [n]

    def to(self, device: torch.device | str) -> Padded:
        return Padded(*(t.to(device) for t in self))


def left_pad(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` left-padded (the layout generation continues from): ids and attention mask."""
    _check_rows("left_pad", "rows", rows)
    rows = [torch.as_tensor(r) for r in rows]  # a list of ids assigns like a tensor
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise ConfigError(f"left_pad: pad_id must be an int token id, got {pad_id!r}")
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = 1
    return ids, mask


def right_pad(rows: Sequence[torch.Tensor], value: float = 0) -> torch.Tensor:
    """``rows`` (1-D, any dtype) right-padded with ``value`` into one ``[n, max_len]`` tensor."""
    _check_rows("right_pad", "rows", rows)
    if len(rows) == 0:
        return torch.zeros((0, 0))
    return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r) for r in rows], batch_first=True, padding_value=value)


def join(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int) -> Padded:
    """Each prompt followed by its response, right-padded: positions count from 0 in every
    row, as in generation (where left pads are skipped by the position ids)."""
    _check_rows("join", "prompts", prompts)
    _check_rows("join", "responses", responses)
    if len(prompts) != len(responses):
        raise ConfigError(
            f"join: expected one response per prompt, got {len(prompts)} prompts and {len(responses)} responses"
        )
    rows = [
        torch.cat([torch.as_tensor(p).long(), torch.as_tensor(r).long()])
        for p, r in zip(prompts, responses, strict=False)
    ]
    p_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    r_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    pos = torch.arange(width)
    attention = (pos[None, :] < (p_len + r_len)[:, None]).long()
    response = ((pos[None, :] >= p_len[:, None]) & (attention == 1)).long()
    return Padded(ids, attention, response, r_len, p_len)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under ``softmax(logits / temperature)``, per position (float32).

    Computed as ``logit[target] - logsumexp(logits)``: no ``[n, T, vocab]`` log-softmax
    tensor is kept, which for a 150k vocabulary is most of a step's memory.
    """
    _check_logits("token_logprobs", logits, targets, temperature)
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def response_values(per_position: torch.Tensor, padded: Padded, shift: bool = True) -> torch.Tensor:
    """``[n, T]`` values of ``join``'s layout gathered onto each response token: ``[n, R]``,
    right-padded with 0. With ``shift`` the value for token ``t`` is read at position ``t - 1``
    (next-token log-probs: the logits at ``t - 1`` predict token ``t``)."""
    n = per_position.shape[0]
    width = int(padded.response_lengths.max()) if n else 0
    out = per_position.new_zeros((n, width))
    for i in range(n):
        start, length = int(padded.prompt_lengths[i]), int(padded.response_lengths[i])
        lo = start - 1 if shift else start
        out[i, :length] = per_position[i, lo : lo + length]
    return out


def sequence_logprobs(
    logits: torch.Tensor, padded: Padded, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each response under ``logits`` (``[n, T, V]`` over ``join``'s
    layout): ``[n, R]`` right-padded with 0, and the ``[n, R]`` mask of real tokens."""
    if not isinstance(padded, Padded):
        raise ConfigError(
            f"sequence_logprobs: padded must be the Padded that join() returns, got {type(padded).__name__}"
        )
    if not isinstance(logits, torch.Tensor) or logits.shape[:2] != padded.input_ids.shape:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ConfigError(
            f"sequence_logprobs: logits must be [n, T, V] with [n, T] = {tuple(padded.input_ids.shape)} "
            f"(padded.input_ids), got {got}"
        )
    next_logp = token_logprobs(logits[:, :-1], padded.input_ids[:, 1:], temperature)
    # position t of next_logp is log p(token t+1); response token j of row i is token p_len+j
    shifted = torch.nn.functional.pad(next_logp, (1, 0))
    values = response_values(shifted, padded, shift=False)
    return values, response_mask(padded.response_lengths, values.shape[1])


def response_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, width]`` float mask: 1 on the first ``lengths[i]`` tokens of row ``i``."""
    return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).float()


def cut_at_stop(tokens: torch.Tensor, stop_ids: Sequence[int]) -> tuple[list[torch.Tensor], list[str]]:
    """Each generated row up to and including its first stop token, and why it ended
    (``"stop"`` or ``"length"``): generation pads the rows that stopped early, and the pads
    go with the cut."""
    rows, reasons = [], []
    stops = torch.tensor(sorted(set(stop_ids)), dtype=tokens.dtype)
    for row in tokens:
        hit = torch.isin(row, stops).nonzero() if len(stops) else torch.empty(0, 1, dtype=torch.long)
        if len(hit):
            end = int(hit[0, 0]) + 1
            rows.append(row[:end].clone())
            reasons.append("stop")
        else:
            rows.append(row.clone())
            reasons.append("length")
    return rows, reasons


def token_micro_batches(lengths: Sequence[int], budget: int, rows: int) -> list[list[int]]:
    """Row indices in order, cut into micro-batches whose padded size (rows x longest row)
    stays within ``budget`` tokens (a longer row goes alone); ``budget=0``: ``rows`` rows each
    (0: all in one)."""
    if budget <= 0:
        size = rows or max(1, len(lengths))
        return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and max(longest, n) * (len(current) + 1) > budget:
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out


def _check_rows(fn: str, name: str, rows: Any) -> None:
    """Refuse ``rows`` unless it is a sequence of 1-D tensors (a token id list each)."""
    # a list column of a batch may be a list or an object array of tensors or numpy arrays
    if isinstance(rows, (str, bytes, Mapping)) or not hasattr(rows, "__len__") or not hasattr(rows, "__getitem__"):
        raise ConfigError(f"{fn}: {name} must be a list of 1-D tensors, got {type(rows).__name__}")
    bad = next((i for i, r in enumerate(rows) if getattr(r, "ndim", 1) != 1 or isinstance(r, (str, bytes))), None)
    if bad is not None:
        row = rows[bad]
        got = f"shape {tuple(row.shape)}" if hasattr(row, "shape") else type(row).__name__
        raise ConfigError(f"{fn}: {name}[{bad}] must be a 1-D tensor, got {got}")


def _check_logits(fn: str, logits: object, targets: object, temperature: object) -> None:
    """``logits`` ``[..., V]`` over integer ``targets`` ``[...]``, and a temperature > 0."""
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ConfigError(
            f"{fn}: logits and targets must be tensors, got {type(logits).__name__} and {type(targets).__name__}"
        )
    if logits.dim() != targets.dim() + 1 or logits.shape[:-1] != targets.shape:
        raise ConfigError(
            f"{fn}: logits must be targets' shape plus a vocabulary dimension, got logits {tuple(logits.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.is_complex():
        raise ConfigError(f"{fn}: targets must be integer token ids, got dtype {targets.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ConfigError(f"{fn}: temperature must be a number > 0, got {temperature!r}")
