"""Inference models over ``transformers``: a sampling policy, a reference, a value model, a
reward model and a rule-based reward. Each is a plain ``flowrl.Model`` (replicas, batch
sizes, colocation and weight sync work as for any model).

Fields (per sample): the policy reads ``prompt`` (a string) and writes ``prompt_ids``,
``response_ids`` and ``logprobs`` (1-D tensors of the sample's own length),
``response_text``, ``finish_reason`` ("stop" or "length") and ``weight_version``; the
reference writes ``ref_logprobs``, the value model ``values`` (per response token), the
reward models ``score``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from .._core.errors import ConfigError
from .._core.flow.model import Model, step
from .._core.settings.config import ModelConfig, to_config
from .config import LM, Sampling
from .loading import Head, checked_paths, context_length, load_module, load_tokenizer, shape_of
from .sampling import RowSampler, seeded
from .tokens import cut_at_stop, join, left_pad, response_values, sequence_logprobs, token_micro_batches

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .._core.flow.batch import Batch

Config = ModelConfig | Mapping[str, Any] | None
LOGIT_BUDGET = 1 << 28  # logits per forward pass when scoring responses (1 GiB in fp32)


class HFModel(Model):
    """A model whose ``self.module`` is a ``transformers`` network built from ``lm`` in
    ``setup`` (on the replica's device), with its tokenizer in ``self.tokenizer``."""

    head: Head = "causal"

    def __init__(self, name: str, config: Config = None, *, lm: LM | Mapping[str, Any]) -> None:
        super().__init__(name, config)
        self.lm = checked_paths(to_config(LM, lm, f"model {name!r} lm"), name)

    def setup(self) -> None:
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.lm, self.name)
        self.module = load_module(self.lm, self.head, self.device, self.tokenizer).eval()

    def check_weights_from(self, trainer: Model) -> None:
        """A trainer syncing into this model must be an HF model of the same architecture
        and head (the engine asks when it is built)."""
        if not isinstance(trainer, HFModel) or trainer.head != self.head:
            what = f"an HF {trainer.head} model" if isinstance(trainer, HFModel) else type(trainer).__name__
            raise ConfigError(
                f"sync pair ({trainer.name!r} -> {self.name!r}): {self.name!r} is an HF {self.head} model and "
                f"takes weights from a trainer with the same network; {trainer.name!r} is {what}"
            )
        if trainer.lm == self.lm or _same_source(trainer.lm, self.lm):
            return
        mine, theirs = shape_of(self.lm), shape_of(trainer.lm)
        differ = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
        if differ:
            detail = ", ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in differ.items())
            raise ConfigError(
                f"sync pair ({trainer.name!r} -> {self.name!r}): the trainer's weights do not fit the model; "
                f"their architectures differ ({detail}; trainer's vs model's LM)"
            )

    def padded(self, batch: Batch) -> Any:
        return join(batch["prompt_ids"], batch["response_ids"], int(self.tokenizer.pad_token_id))

    def response_logprobs(
        self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], temperature: float
    ) -> list[torch.Tensor]:
        """Each response's per-token log-probs under this model (one 1-D tensor per sample),
        by forward passes over chunks small enough that their logits stay near 1 GiB: a
        ``[n, T, vocab]`` tensor of a whole batch would not fit (256 x 300 tokens x 152k
        vocabulary is 47 GB in fp32)."""
        vocab = int(getattr(self.module.config, "vocab_size", 1) or 1)
        budget = max(1, LOGIT_BUDGET // vocab)
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        out: list[torch.Tensor] = []
        for chunk in token_micro_batches(lengths, budget, 0):
            padded = join([prompts[i] for i in chunk], [responses[i] for i in chunk], int(self.tokenizer.pad_token_id))
            logits = self.module(
                input_ids=padded.input_ids.to(self.device), attention_mask=padded.attention_mask.to(self.device)
            ).logits
            values, _ = sequence_logprobs(logits, padded.to(self.device), temperature)
            out.extend(rows(values, padded.response_lengths))
        return out


def _same_source(a: LM, b: LM) -> bool:
    """The same weights and network, whatever the dtype (a trainer keeps fp32)."""
    return (a.path, a.gguf_file, a.config, a.seed) == (b.path, b.gguf_file, b.config, b.seed)


def rows(values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Row ``i`` of ``values`` cut to ``lengths[i]``, on the CPU (ragged per-sample fields)."""
    values = values.detach().float().cpu()
    return [values[i, : int(n)].clone() for i, n in enumerate(lengths)]


class HFPolicy(HFModel):
    """Samples one response per sample from a causal LM (KV-cached ``generate``), with the
    per-token log-probs of the sampling distribution (the logits over ``temperature``,
    before top-p/top-k, as the trainer computes them)."""

    def __init__(
        self,
        name: str,
        config: Config = None,
        *,
        lm: LM | Mapping[str, Any],
        sampling: Sampling | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(name, config, lm=lm)
        self.sampling = to_config(Sampling, sampling, f"model {name!r} sampling")

    def setup(self) -> None:
        super().setup()
        generation = getattr(self.module, "generation_config", None)
        self.limits(context_length(self.module), getattr(generation, "eos_token_id", None))

    def limits(self, context: int | None, eos: int | list[int] | None) -> None:
        """The stop tokens and the prompt budgets, from the model's context length and its
        generation config's eos token(s) (after ``self.tokenizer`` is loaded)."""
        s, tok = self.sampling, self.tokenizer
        self.stop_ids = sorted({*s.stop_token_ids, *eos_ids(tok, eos)})
        self.max_prompt = s.max_prompt_tokens or (context - s.max_new_tokens if context else None)
        total = s.max_response_tokens or s.max_new_tokens
        self.max_prompt_total = s.max_prompt_tokens or (context - total if context else None)  # continue_step's
        if self.max_prompt is not None and self.max_prompt <= 0:
            raise ConfigError(
                f"model {self.name!r}: Sampling.max_new_tokens={s.max_new_tokens} leaves no room for a "
                f"prompt in the model's context of {context} tokens"
            )
        self.use_template = s.chat_template if s.chat_template is not None else bool(tok.chat_template)
        if self.use_template and not tok.chat_template:
            raise ConfigError(f"model {self.name!r}: Sampling.chat_template=True, but the tokenizer has no template")

    def check_weights_from(self, trainer: Model) -> None:
        """Also: the trainer computes log-probs at the temperature this policy samples at
        (otherwise the first step's ratio is not 1 and clipping acts on a mismatch)."""
        super().check_weights_from(trainer)
        train = getattr(trainer, "train_config", None)
        mine = self.sampling.temperature or 1.0  # greedy sampling records the model's own log-probs
        if train is not None and train.temperature != mine:
            raise ConfigError(
                f"sync pair ({trainer.name!r} -> {self.name!r}): the policy samples at temperature {mine} "
                f"(Sampling.temperature) and the trainer computes log-probs at {train.temperature} "
                "(Train.temperature); give both the same"
            )

    def encode(self, prompt: str | list[dict[str, str]]) -> torch.Tensor:
        """The prompt's token ids: a string (a user message under the chat template, when one
        is used), or a conversation (a list of ``{"role", "content"}`` messages, e.g. with
        few-shot examples), which needs the template."""
        tok = self.tokenizer
        if isinstance(prompt, list) and self.use_template:
            messages = list(prompt)
        elif not isinstance(prompt, str):
            raise ConfigError(
                f"model {self.name!r}: field 'prompt' holds strings, or lists of chat messages when the tokenizer "
                f"has a chat template; got {type(prompt).__name__}"
            )
        else:
            messages = [{"role": "user", "content": prompt}]
        if self.use_template:
            if self.sampling.system_prompt is not None:
                messages.insert(0, {"role": "system", "content": self.sampling.system_prompt})
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    @torch.no_grad()
    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        return self.respond(batch, self.sampling)

    @torch.no_grad()
    def eval_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        """Greedy responses (temperature 0), for an engine's ``eval_flow``."""
        return self.respond(batch, msgspec.structs.replace(self.sampling, temperature=0.0))

    def prompts(self, batch: Batch, limit: int | None, budget: str) -> list[torch.Tensor]:
        """Each sample's prompt ids; one longer than ``limit`` is an error naming the sample."""
        prompts = [self.encode(p) for p in batch["prompt"]]
        for sample, ids in zip(batch.ids.tolist(), prompts, strict=True):
            if limit is not None and len(ids) > limit:
                raise ConfigError(
                    f"model {self.name!r}: the prompt of sample {sample} has {len(ids)} tokens, more than "
                    f"{limit} (Sampling.max_prompt_tokens, or the context less {budget})"
                )
        return prompts

    def respond(self, batch: Batch, sampling: Sampling) -> dict[str, Any]:
        prompts = self.prompts(batch, self.max_prompt, "max_new_tokens")
        responses, reasons, logprobs = self.sample(prompts, sampling, batch)
        return {
            "prompt_ids": prompts,
            "response_ids": responses,
            **({} if logprobs is None else {"logprobs": logprobs}),
            "response_text": [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses],
            "finish_reason": reasons,
            "weight_version": torch.full((len(prompts),), self.weight_version, dtype=torch.long),
        }

    @step
    @torch.no_grad()
    def continue_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        """One segment of a partial rollout, for ``flowrl.loop(policy.continue_step, prompts,
        until="finished", ...)``: writes at most ``Sampling.max_new_tokens`` more tokens of each
        response, after the prompt and the response so far (encoded again: no KV cache moves
        between calls, so any replica continues any sample). ``response_ids`` and ``logprobs``
        are the loop's state (give each item ``[]`` for both); a sample is ``finished`` at a
        stop token or at ``Sampling.max_response_tokens``. Each segment's log-probs are those of
        the weights that wrote it (``policy_versions`` on the loop's output says which). With a
        ``loss_mask`` in the state (``[]`` to start), it appends 1 per token it writes: a tool
        that appends its own tokens to the response appends 0s, and the trainers leave them out."""
        s = self.sampling
        total = s.max_response_tokens or s.max_new_tokens
        prompts = self.prompts(batch, self.max_prompt_total, "max_response_tokens")
        done = [torch.as_tensor(r, dtype=torch.long) for r in batch["response_ids"]]
        budget = min(s.max_new_tokens, max(1, total - min(len(r) for r in done)))
        step = msgspec.structs.replace(s, max_new_tokens=budget)
        prefixes = [torch.cat([p, r]) for p, r in zip(prompts, done, strict=True)]
        new, reasons, more = self.sample(prefixes, step, batch)
        room = [max(0, total - len(r)) for r in done]  # never past the total: a cut row ends by length
        reasons = [why if len(n) <= k else "length" for why, n, k in zip(reasons, new, room, strict=True)]
        new = [n[:k] for n, k in zip(new, room, strict=True)]
        responses = [torch.cat([r, n]) for r, n in zip(done, new, strict=True)]
        finished = [why == "stop" or len(r) >= total for why, r in zip(reasons, responses, strict=True)]
        out: dict[str, Any] = {}
        if more is not None:  # each segment's log-probs, after those of the segments before
            out["logprobs"] = [
                torch.cat([torch.as_tensor(a, dtype=torch.float32), b[:k]])
                for a, b, k in zip(batch["logprobs"], more, room, strict=True)
            ]
        if "loss_mask" in batch:  # a multi-turn rollout: the policy's tokens count in the losses
            out["loss_mask"] = [
                torch.cat([torch.as_tensor(m, dtype=torch.float32), torch.ones(len(n))])
                for m, n in zip(batch["loss_mask"], new, strict=True)
            ]
        return out | {
            "prompt_ids": prompts,
            "response_ids": responses,
            "finished": finished,
            "finish_reason": ["stop" if why == "stop" else "length" for why in reasons],
            "response_text": [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses],
        }

    def sample(
        self, prompts: list[torch.Tensor], s: Sampling, batch: Batch
    ) -> tuple[list[torch.Tensor], list[str], list[torch.Tensor] | None]:
        """Each prompt's response (up to and including its first stop token), why it ended
        (``"stop"`` or ``"length"``) and the log-probs of its tokens at the sampling
        temperature (greedy: the model's own; None: a sampler that does not give them)."""
        responses, reasons = cut_at_stop(self.generate(prompts, s, batch), self.stop_ids)
        return responses, reasons, self.response_logprobs(prompts, responses, s.temperature or 1.0)

    def generate(self, prompts: list[torch.Tensor], s: Sampling, batch: Batch) -> torch.Tensor:
        """Generated tokens ``[n, R]``, KV-cached; rows that stopped early are padded. Each
        row samples from its sample's own stream (``batch.generators``, moved by
        ``Sampling.seed``): the same tokens on any replica, in any shard."""
        from transformers import GenerationConfig, LogitsProcessorList

        pad = int(self.tokenizer.pad_token_id)
        ids, mask = left_pad(prompts, pad)
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,  # greedy over the rows' Gumbel-perturbed logits: a draw per row
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=s.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=pad,
        )
        rows = [] if s.temperature == 0 else [RowSampler(s, seeded(batch.generators(self.device), s.seed))]
        generate: Any = self.module.generate
        out = generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=config,
            logits_processor=LogitsProcessorList(rows),
        )
        tokens: torch.Tensor = out[:, ids.shape[1] :].cpu()
        return tokens


def eos_ids(tokenizer: PreTrainedTokenizerBase, extra: int | list[int] | None) -> set[int]:
    """The tokenizer's eos token and the generation config's (one id or several)."""
    ids = {tokenizer.eos_token_id, *(extra if isinstance(extra, list) else [extra])}
    return {int(i) for i in ids if i is not None}


class HFReference(HFModel):
    """Per-token log-probs of given responses (``ref_logprobs``) under a frozen causal LM;
    ``temperature`` must match the policy's sampling temperature."""

    def __init__(
        self, name: str, config: Config = None, *, lm: LM | Mapping[str, Any], temperature: float = 1.0
    ) -> None:
        super().__init__(name, config, lm=lm)
        self.temperature = temperature
        self.output = "ref_logprobs"

    @torch.no_grad()
    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        return {self.output: self.response_logprobs(batch["prompt_ids"], batch["response_ids"], self.temperature)}


class HFValue(HFModel):
    """A value estimate per response token (``values``): a linear head on a causal LM's body;
    the value of token ``t`` is read at the position before it (the state it was chosen in)."""

    head: Head = "value"

    @torch.no_grad()
    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        padded = self.padded(batch)
        values = self.module(padded.input_ids.to(self.device), padded.attention_mask.to(self.device))
        return {"values": rows(response_values(values.cpu(), padded), padded.response_lengths)}


class HFRewardModel(HFModel):
    """A sequence classifier with one label scores prompt + response (``score``)."""

    head: Head = "reward"

    @torch.no_grad()
    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        padded = self.padded(batch)
        out = self.module(
            input_ids=padded.input_ids.to(self.device), attention_mask=padded.attention_mask.to(self.device)
        )
        return {"score": out.logits[:, 0].float().cpu()}


class RuleReward(Model):
    """A verifiable reward: ``fn(prompt, response, **fields) -> float`` per sample, where
    ``response`` is the decoded response and ``fields`` the sample's other fields (e.g. an
    ``answer`` from the data set). ``fn`` must be importable (a module-level function) so
    replicas can receive it. Writes ``score``."""

    def __init__(self, name: str, config: Config = None, *, fn: Callable[..., float] | str) -> None:
        super().__init__(name, config)
        self.fn = _resolve(fn, name) if isinstance(fn, str) else fn
        if not callable(self.fn):
            raise ConfigError(f"model {name!r}: fn must be a function, got {type(fn).__name__}")

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        scores = []
        for i, sample in enumerate(batch.ids.tolist()):
            fields = batch.row(i)
            prompt, response = fields.pop("prompt"), fields.pop("response_text")
            try:
                value = float(self.fn(prompt, response, **fields))
            except Exception as err:
                raise ValueError(
                    f"reward {self.name!r}: {_name(self.fn)} raised {type(err).__name__}: {err} on sample {sample}"
                ) from err
            if not math.isfinite(value):
                raise ValueError(f"reward {self.name!r}: {_name(self.fn)} returned {value} for sample {sample}")
            scores.append(value)
        return {"score": torch.tensor(scores, dtype=torch.float32)}


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _resolve(target: str, model: str) -> Callable[..., float]:
    """``"package.module:function"`` (how a run file names the function)."""
    import importlib

    module, _, attr = target.partition(":")
    try:
        fn: Callable[..., float] = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"model {model!r}: fn={target!r} is not an importable 'module:function' ({err})") from err
    return fn
