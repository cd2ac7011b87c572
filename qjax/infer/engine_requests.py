"""The engine's request side: checking and queuing requests, streaming their tokens or text,
and reading what each produced.

`Requests` owns every request's `SequenceState` by id; it reaches the rest of the engine
through three things it is given: the scheduler (to check, queue and cancel requests), a
`step()` that runs the engine one step and returns its (request id, token) events, and a
`settle()` that books what is queued on the device (so that a cancelled request's state is
final), with `busy()` telling whether steps remain.

Every request is checked when it is added (`qjax.nn.validate` for the token ids, the
scheduler for a request that could never fit), and a batch is all-or-nothing: one bad
prompt queues none. A request that fails while it runs (non-finite logits) ends alone, with
finish reason 'error'; `generate` then raises `GenerationError`, which carries every
prompt's output. `cancel` ends a request early; a `stream` closed or dropped before its
requests finish cancels them, so they never run inside a later call.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from qjax.infer.sampling import SamplingParams, trim_stop_string
from qjax.infer.scheduler import SequenceState
from qjax.nn import validate


class GenerationError(FloatingPointError):
  """`Engine.generate`: some requests ended with 'error'; nothing computed is lost.

  Attributes:
    outputs: every prompt's generated tokens, in order (a failed one's up to its failure).
    finish_reasons: every prompt's finish reason ('stop', 'length', 'error', ...).
    errors: every prompt's error message, or None.
    request_ids: every prompt's request id (for `Engine.finish_reason`, `error`, ...).
  """

  def __init__(self, message: str, outputs, finish_reasons, errors, request_ids):
    super().__init__(message)
    self.outputs, self.finish_reasons = outputs, finish_reasons
    self.errors, self.request_ids = errors, request_ids


class _Stream:
  """The events of `Engine.stream`; closing or dropping it before the end cancels its
  requests that have not finished (the engine then never runs them for another caller)."""

  def __init__(self, requests: 'Requests', ids):
    self._requests, self._ids, self._events = requests, ids, requests.run()

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._events)

  def close(self) -> None:
    """Cancel this stream's unfinished requests."""
    self._events.close()
    for rid in self._ids:
      if not self._requests.seq(rid).finished:
        self._requests.cancel(rid)

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass  # an engine torn down with the interpreter: nothing left to cancel


class Requests:
  """Adding requests and reading their outputs (module docstring).

  Args:
    scheduler: checks, queues and cancels requests.
    vocab_size: the model's vocabulary (token ids are checked against it).
    tokenizer: encodes text prompts and decodes outputs (optional).
    step: runs one engine step; returns its (request id, token) events.
    busy: whether steps remain.
    settle: books a dispatch queued on the device.
    check: `check(seq)` raises for a request the engine cannot serve (optional).
  """

  def __init__(self, scheduler, vocab_size: int, tokenizer, *, step: Callable,
               busy: Callable, settle: Callable, check: Optional[Callable] = None):
    self.scheduler, self.vocab_size, self.tokenizer = scheduler, vocab_size, tokenizer
    self._step, self._busy, self._settle, self._check = step, busy, settle, check
    self._ids = itertools.count()
    self._seqs: dict[str, SequenceState] = {}

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

  def _prepare(self, prompt, params, request_id, taken=()) -> SequenceState:
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
    vocab = self.vocab_size
    prompt = validate.token_ids(prompt, vocab, f'request {rid}', ndim=1)
    params.check_vocab(vocab)
    if params.stop_strings and self.tokenizer is None:
      raise ValueError(f'request {rid}: stop_strings={params.stop_strings!r} need the output '
                       'text; build the engine with Engine(..., tokenizer=).')
    seq = SequenceState(rid, np.asarray(prompt).tolist(), params.max_tokens, params)
    self.scheduler.check(seq)  # raises for a request that can never fit
    if self._check is not None:
      self._check(seq)
    return seq

  def _queue(self, seqs) -> None:
    for seq in seqs:
      self.scheduler.add(seq)
      self._seqs[seq.id] = seq

  def stream(self, prompts: Sequence, params=None) -> Iterator[tuple[str, int]]:
    """Queue `prompts` and yield (request id, token) as the steps generate them (other
    queued requests' tokens too). Closing the iterator, or dropping it, before the end
    cancels the requests it queued that have not finished.

    Args:
      prompts: token-id lists (or texts, with a tokenizer).
      params: one SamplingParams for all, a list of one per prompt, or None (greedy).
    """
    return _Stream(self, self._add_all(prompts, params))

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
    back while it ends in an incomplete character (U+FFFD) or in the start of a stop string,
    so the pieces concatenate to `tokenizer.decode(output)` cut before the first stop string
    (`trim_stop_string`). Other queued requests run alongside it; closing the iterator early
    cancels the request.
    """
    if self.tokenizer is None:
      raise ValueError('Engine.stream_text: build the engine with Engine(..., tokenizer=).')
    rid = self.add_request(prompt, params)
    seq = self.seq(rid)
    stops = seq.params.stop_strings
    shown = ''
    try:
      for got, _ in self.run():
        if got != rid:
          continue
        text = trim_stop_string(self.tokenizer.decode(seq.output), seq.params)
        if not seq.finished:
          text = text[:len(text) - _stop_prefix(text, stops)]
        if text.startswith(shown) and len(text) > len(shown) and not text.endswith('\ufffd'):
          yield text[len(shown):]
          shown = text
      text = trim_stop_string(self.tokenizer.decode(seq.output), seq.params)
      if text != shown:
        yield text[len(shown):] if text.startswith(shown) else text
    finally:
      if not seq.finished:
        self.cancel(rid)

  def run(self) -> Iterator[tuple[str, int]]:
    """Step until every queued request is done, yielding (request id, token) events."""
    while self._busy():
      yield from self._step()

  def generate(self, prompts: Sequence, params=None) -> list[list[int]]:
    """The generated tokens of every prompt (in order), running them as one stream.

    Every request is checked before any is queued: a bad one raises and queues none.

    Raises:
      GenerationError: a request's logits turned non-finite (it ended with finish reason
        'error'; the others ran to their end unharmed). The error names each failed prompt
        and carries every prompt's output, finish reason and request id.
    """
    ids = self._add_all(prompts, params)
    for _ in self.run():
      pass
    seqs = [self._seqs[i] for i in ids]
    failed = [(i, s) for i, s in enumerate(seqs) if s.finish_reason not in ('stop', 'length')]
    if failed:
      i, first = failed[0]
      raise GenerationError(
          f'Engine.generate: {len(failed)} of {len(seqs)} prompts failed (prompt indices '
          f'{[j for j, _ in failed][:10]}); prompt {i}: {first.error or first.finish_reason}. '
          'The other prompts finished; every output is in this error\'s .outputs (and '
          '.finish_reasons, .errors, .request_ids).',
          [s.output for s in seqs], [s.finish_reason for s in seqs], [s.error for s in seqs],
          ids)
    return [s.output for s in seqs]

  def cancel(self, request_id: str) -> bool:
    """End `request_id` now (waiting or running) with finish reason 'cancelled', freeing its
    row and pages; its tokens so far stay readable. Returns False if it had already
    finished."""
    seq = self.seq(request_id)
    if not seq.finished:
      self._settle()  # a dispatch queued on the device may hold its row: book it first
    if seq.finished:
      return False
    self.scheduler.cancel(seq)
    return True

  def seq(self, request_id) -> SequenceState:
    """The state of `request_id`; raises KeyError, naming the known ids, for an unknown one."""
    seq = self._seqs.get(str(request_id))
    if seq is None:
      known = sorted(self._seqs)
      raise KeyError(f'Engine: no request with id {request_id!r}; the ids are those '
                     f'add_request returned ({len(known)} known: {known[:5]}'
                     f'{"..." if len(known) > 5 else ""}).')
    return seq

  def output(self, request_id: str) -> list[int]:
    """Tokens generated so far for `request_id`."""
    return self.seq(request_id).output

  def finish_reason(self, request_id: str) -> Optional[str]:
    """'stop', 'length', 'error' (non-finite logits: see `error`), 'cancelled' (`cancel`),
    or None while it runs."""
    return self.seq(request_id).finish_reason

  def error(self, request_id: str) -> Optional[str]:
    """Why `request_id` ended with finish reason 'error', else None."""
    return self.seq(request_id).error

  def prefix_hit_tokens(self, request_id: str) -> int:
    """Prompt positions `request_id` took from the prefix cache when last admitted (0: a
    miss, or no prefix caching); a recompute preemption resets it."""
    return self.seq(request_id).prefix_hit_tokens

  def logprobs(self, request_id: str) -> list[float]:
    """Model log-probabilities of the generated tokens (requests with `logprobs=True`)."""
    seq = self.seq(request_id)
    if not seq.params.logprobs:
      raise ValueError(f'request {request_id}: log-probabilities were not requested; pass '
                       'SamplingParams(logprobs=True).')
    return seq.logprobs


def _stop_prefix(text: str, stops) -> int:
  """Length of the longest end of `text` that begins a stop string (held back: the next
  token may complete it)."""
  return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1)
              if text.endswith(s[:n])), default=0)
