"""The engine's request side: checking and queuing requests, streaming their tokens or text,
and reading what each produced (`Engine`'s mixin: it uses the engine's scheduler, model,
tokenizer and `step`).

Every request is checked when it is added (`qjax.nn.validate` for the token ids, the
scheduler for a request that could never fit), and a batch is all-or-nothing: one bad
prompt queues none.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import numpy as np

from qjax.infer.sampling import SamplingParams, finish_reason
from qjax.infer.scheduler import Sequence as SeqState
from qjax.nn import validate


class Requests:
  """Adding requests and reading their outputs (a mixin of `qjax.infer.Engine`)."""

  def add_request(self, prompt: Union[str, Sequence[int]],
                  params: Optional[SamplingParams] = None,
                  request_id: Optional[str] = None) -> str:
    """Queue a request; returns its id. Raises (this request only) on bad input.

    Args:
      prompt: token ids (a 1-d list or array of ints in [0, vocab)), or text when the
        engine has a tokenizer.
      params: sampling parameters (default greedy, 16 tokens).
      request_id: a name for it (default: a counter).
    """
    seq = self._prepare(prompt, params, request_id)
    self._queue([seq])
    return seq.id

  def _prepare(self, prompt, params, request_id, taken=()) -> SeqState:
    """A checked request, not queued: raises on bad input (`qjax.nn.validate`) or a request
    that could never fit; `taken` holds ids of requests prepared alongside it."""
    params = SamplingParams(temperature=0.0) if params is None else params
    rid = str(next(self._ids)) if request_id is None else str(request_id)
    while request_id is None and (rid in self._seqs or rid in taken):
      rid = str(next(self._ids))
    if rid in self._seqs or rid in taken:
      raise ValueError(f'request {rid}: the id is already in use; pass another request_id.')
    if not isinstance(params, SamplingParams):
      raise ValueError(f'request {rid}: params={params!r} is a {type(params).__name__}, not a '
                       'SamplingParams; pass SamplingParams(...) (e.g. '
                       'SamplingParams(**that_dict)).')
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError(f'request {rid}: a text prompt needs Engine(..., tokenizer=).')
      encoded = self.tokenizer.encode(prompt)
      prompt = list(getattr(encoded, 'ids', encoded))  # a `tokenizers` Encoding, or a list
    vocab = self.model.config.vocab_size
    prompt = validate.token_ids(prompt, vocab, f'request {rid}', ndim=1)
    params.check_vocab(vocab)
    if params.stop_strings and self.tokenizer is None:
      raise ValueError(f'request {rid}: stop_strings={params.stop_strings!r} need the output '
                       'text; build the engine with Engine(..., tokenizer=).')
    seq = SeqState(rid, np.asarray(prompt).tolist(), params.max_tokens, params)
    self.scheduler.check(seq)  # raises for a request that can never fit
    return seq

  def _queue(self, seqs) -> None:
    for seq in seqs:
      self.scheduler.add(seq)
      self._seqs[seq.id] = seq

  def _finished(self, seq: SeqState) -> bool:
    text = None
    if seq.params.stop_strings and self.tokenizer is not None:
      text = self.tokenizer.decode(seq.output)
    seq.finish_reason = finish_reason(seq.params, seq.output, text)
    return seq.finish_reason is not None

  def stream(self, prompts: Sequence, params=None) -> Iterator[tuple[str, int]]:
    """Queue `prompts` and yield (request id, token) as the steps generate them.

    Args:
      prompts: token-id lists (or texts, with a tokenizer).
      params: one SamplingParams for all, a list of one per prompt, or None (greedy).
    """
    self._add_all(prompts, params)
    return self.run()

  def _add_all(self, prompts, params) -> list[str]:
    """Check every request, then queue them all (a bad one queues none)."""
    if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
      raise ValueError('Engine: prompts must be a list of prompts (token-id lists or texts); '
                       'for one prompt pass [prompt] (or use add_request).')
    plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
      raise ValueError(f'{len(plist)} SamplingParams for {len(prompts)} prompts; give one per '
                       'prompt or a single one.')
    seqs, taken = [], set()
    for prompt, prm in zip(prompts, plist):
      seqs.append(self._prepare(prompt, prm, None, taken))
      taken.add(seqs[-1].id)
    self._queue(seqs)
    return [seq.id for seq in seqs]

  def stream_text(self, prompt: Union[str, Sequence[int]],
                  params: Optional[SamplingParams] = None) -> Iterator[str]:
    """Serve one request and yield its output text as it grows (needs a tokenizer).

    The whole output is decoded after each token and only the new suffix is yielded, held
    back while it ends in an incomplete character (U+FFFD), so the pieces concatenate to
    `tokenizer.decode(output)`. Other queued requests run alongside it.
    """
    if self.tokenizer is None:
      raise ValueError('Engine.stream_text: build the engine with Engine(..., tokenizer=).')
    rid = self.add_request(prompt, params)
    shown = ''
    for got, _ in self.run():
      if got != rid:
        continue
      text = self.tokenizer.decode(self._seqs[rid].output)
      if text.startswith(shown) and len(text) > len(shown) and not text.endswith('\ufffd'):
        yield text[len(shown):]
        shown = text
    text = self.tokenizer.decode(self._seqs[rid].output)
    if text != shown:
      yield text[len(shown):] if text.startswith(shown) else text

  def run(self) -> Iterator[tuple[str, int]]:
    """Step until every queued request is done, yielding (request id, token) events."""
    while self.scheduler.has_work:
      yield from self.step()

  def generate(self, prompts: Sequence, params=None) -> list[list[int]]:
    """The generated tokens of every prompt (in order), running them as one stream.

    Every request is checked before any is queued: a bad one raises and queues none. A
    request whose logits turn non-finite ends early with finish reason 'error'
    (`finish_reason`, `error`).
    """
    ids = self._add_all(prompts, params)
    for _ in self.run():
      pass
    return [self._seqs[i].output for i in ids]

  def _seq(self, request_id) -> SeqState:
    seq = self._seqs.get(str(request_id))
    if seq is None:
      known = sorted(self._seqs)
      raise KeyError(f'Engine: no request with id {request_id!r}; the ids are those '
                     f'add_request returned ({len(known)} known: {known[:5]}'
                     f'{"..." if len(known) > 5 else ""}).')
    return seq

  def output(self, request_id: str) -> list[int]:
    """Tokens generated so far for `request_id`."""
    return self._seq(request_id).output

  def finish_reason(self, request_id: str) -> Optional[str]:
    """'stop', 'length', 'error' (non-finite logits: see `error`), or None while it runs."""
    return self._seq(request_id).finish_reason

  def error(self, request_id: str) -> Optional[str]:
    """Why `request_id` ended with finish reason 'error', else None."""
    return self._seq(request_id).error

  def prefix_hit_tokens(self, request_id: str) -> int:
    """Prompt positions `request_id` took from the prefix cache when last admitted (0: a
    miss, or no prefix caching); a recompute preemption resets it."""
    return self._seq(request_id).prefix_hit_tokens

  def logprobs(self, request_id: str) -> list[float]:
    """Model log-probabilities of the generated tokens (requests with `logprobs=True`)."""
    seq = self._seq(request_id)
    if not seq.params.logprobs:
      raise ValueError(f'request {request_id}: log-probabilities were not requested; pass '
                       'SamplingParams(logprobs=True).')
    return seq.logprobs
