r"""raptor_jax against PyTorch + Opacus on the same model, weights and DP step.

One command builds a small random Switch Transformer with `transformers`,
saves it, and loads the same weights into both sides:

* raptor_jax: `models.from_pretrained(..., num_labels=2, lora_rank=r,
  attention_lora=True, expert_lora_layers=(l*,))`, l* the last sparse block;
  every LoRA B factor is then set to small random values (so that every
  adapter has a gradient) and the torch side gets the same values.
* PyTorch: `transformers.SwitchTransformersEncoderModel` with LoRA (same A,
  B, alpha / r) on attention q, k, v, o of every block and the same mean
  pooling + linear head.

Columns (median ms of interleaved rounds, same records on both sides):

  torch          non-private step: mean loss, backward, Adam.
  opacus         shared DP step with Opacus in its fastest `grad_sample_mode`
                 among hooks, functorch, ew and ghost (each is timed; the
                 per-mode times are printed too): per-sample gradients of the
                 attention LoRA + head, flat clip C, noise, Adam.
  raptor         the trainer's non-private step (`train.step.PhaseStep` of a
                 non-private phase: gradient of the summed loss of the
                 attention LoRA + head over the microbatch size, Adam).
  raptor DP      the trainer's shared DP step (`PhaseStep`: vmap(grad) per
                 record, clip, float32 sum, noise once, Adam).
  opacus expert  Opacus with LoRA on EVERY expert of l* (masked dispatch:
                 each expert runs on every token, its output masked by the
                 router), in the fastest shared mode.
  raptor expert  RAPTOR's expert phase through `PhaseStep`: each record's
                 gradient reaches its owner's slice only (owner slices, the
                 trainer's default residual weight 'shared', sum by owner,
                 noise on every expert, Adam).
The torch columns take the fastest host-memory setting too (below).

Before timing, each pair is checked to compute the same update with the noise
off: the non-private gradients, Opacus's clipped and averaged gradient
(`DPOptimizer.pre_step` with noise_multiplier 0) against raptor_jax's
clipped sums over the public denominator, and for the expert stream
raptor_jax's per-owner sums against a reference built from Opacus's
per-sample gradients (the owner's rows of each record's every-expert
gradient, weighted, clipped, summed by owner). The reference is torch in
float64 (relative error ||a - b|| / ||b|| over all leaves below --tolerance);
every float32 Opacus mode is also checked against raptor_jax's shared update
(below --fp32_tolerance). Measured at the full sizes, m=8: raptor_jax
against torch float64, non-private 3.7e-6; against every float32 Opacus mode
7.3e-6; expert stream against the float64 reference 1e-6; but torch float32
non-private against torch float64, and raptor_jax against float64 Opacus,
2e-4 (not tracked down; a routing near-tie is one candidate), hence the
default tolerances. At the --quick sizes everything agrees to ~1e-6.

Processes (`--isolate`, the default): the checks run in this process; the
timing runs in worker processes, each this script with `--serve`: one for
raptor_jax, whose first lines make the public set-up call a user's program
makes, `raptor_jax.process.setup` (the trainer's: host memory kept, set
before any import, and one XLA CPU device per core), and
one torch worker per `--torch_host_memory` setting: 'glibc' (the defaults,
as torch users run it) and 'keep' (`keep_freed_memory`, the same setting as
raptor_jax). The parent asks the workers for one step at a time, column
after column, round after round, so no two steps ever run at once and all
see the same machine state; each framework has its process and allocator
to itself, as in real use. `--noisolate` times everything in this one
process instead (the issue's original setup): torch and XLA then share one
heap, so host memory is returned each step unless `--keep_host_memory`
(with it, torch's tensors land in the holes between raptor_jax's buffers,
and at microbatch 128 a later raptor_jax step found no hole large enough
and grew the heap again: 235k page faults in one round, +0.9 GB; see
results/vs_opacus/README.md).

Threads: torch gets `torch.set_num_threads(--threads)`; `--omp=passive` (the
default) sets OMP_WAIT_POLICY=PASSIVE before torch is imported (stable when
other work shares the cores), `--omp=default` leaves torch's own threading.
XLA's CPU client uses every core the process may run on; run under
`taskset -c 0-1` (or on a 2-core machine) for 2 cores on both sides. raptor_jax
splits them into `--cpu_devices` XLA devices (0: one per core, the most
that divides every microbatch size).

  python -m launch.bench.vs_opacus                      # the full table
  python -m launch.bench.vs_opacus --omp=default        # torch's own threading
  python -m launch.bench.vs_opacus --quick              # tiny sizes, a few s
"""

from __future__ import annotations

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

if __name__ == '__main__':  # first, before any library starts a thread
  if '--serve=raptor' in sys.argv:  # the public set-up call, as a user's
    from raptor_jax import process as _process  # program makes it

    _process.setup(argv=sys.argv)
  else:
    from raptor_jax import host_memory as _host_memory

    _host_memory.keep_unless_disabled(sys.argv, default=False)

import dataclasses
import os
import tempfile

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from launch.bench import benchmark
from launch.bench import harness
from launch.bench import profiling
from raptor_jax import host_devices, models, roles
from raptor_jax.train import parallel

MODES = ('hooks', 'functorch', 'ew', 'ghost')


def define_flags() -> None:
  """Command-line flags (only when run as a script)."""
  flags.DEFINE_bool('quick', False, 'Tiny sizes, one round: a smoke test.')
  flags.DEFINE_list('microbatch_sizes', ['8', '32', '128'], 'Microbatch sizes.')
  flags.DEFINE_list('modes', list(MODES), 'Opacus grad_sample_modes to time.')
  flags.DEFINE_integer('repeats', 5, 'Timed interleaved rounds.')
  flags.DEFINE_integer('threads', 2, 'torch.set_num_threads.')
  flags.DEFINE_enum(
      'omp', 'passive', ['passive', 'default'], 'OMP_WAIT_POLICY of torch.'
  )
  flags.DEFINE_bool(
      'isolate',
      True,
      'Time each side in its own worker processes (taking turns); '
      '--noisolate times both sides in this one process.',
  )
  flags.DEFINE_list(
      'torch_host_memory',
      ['glibc', 'keep'],
      'Isolated mode: one torch worker per host-memory setting (glibc: the '
      'defaults; keep: keep_freed_memory, as raptor_jax runs); the table '
      'takes the faster one per column.',
  )
  flags.DEFINE_bool(
      'keep_host_memory',
      False,
      '--noisolate: raptor_jax.host_memory.keep_freed_memory() for the whole '
      'process; off by default there, as torch would share, and fragment, that '
      'one heap. (The isolated raptor_jax worker always keeps it, as '
      'launch/main.py does.)',
  )
  flags.DEFINE_integer(
      'cpu_devices',
      0,
      'raptor_jax on CPU: XLA devices the host is split into (0: one per '
      'core, as launch/main.py; 1: one device). See raptor_jax/host_devices.py.',
  )
  flags.DEFINE_enum(
      'serve', '', ['', 'raptor', 'torch'], 'Internal: run as a timing worker.'
  )
  flags.DEFINE_string('model_path', '', "Internal: the worker's checkpoint.")
  flags.DEFINE_float(
      'tolerance', 1e-3, 'Largest relative error against torch in float64.'
  )
  flags.DEFINE_float(
      'fp32_tolerance', 1e-2, 'Largest relative error against torch float32.'
  )


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The model and data sizes of one comparison."""

  d_model: int = 256
  d_kv: int = 64
  num_heads: int = 4
  d_ff: int = 1024
  num_layers: int = 4
  num_experts: int = 8
  expert_capacity: int = 64
  vocab_size: int = 8000
  seq_len: int = 128
  lora_rank: int = 8
  lora_alpha: float = 16.0
  buckets: int = 32
  max_distance: int = 128

  @property
  def expert_layer(self) -> int:
    """l*: the last sparse block (every 2nd block is sparse)."""
    return self.num_layers - 1 if self.num_layers % 2 == 0 else 1


QUICK = Sizes(
    d_model=16,
    d_kv=8,
    num_heads=2,
    d_ff=32,
    num_layers=2,
    num_experts=4,
    expert_capacity=5,
    vocab_size=50,
    seq_len=12,
    lora_rank=2,
    lora_alpha=4.0,
    buckets=8,
    max_distance=20,
)
L2_CLIP = 0.05  # small enough that most records are clipped


# ---------------------------------------------------------------------------
# One model, saved by transformers, loaded by both sides.


def save_switch(path: str, sizes: Sizes, seed: int = 0) -> str:
  """A random HF Switch (every 2nd block sparse) saved with `save_pretrained`."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  torch.manual_seed(seed)
  config = transformers.SwitchTransformersConfig(
      vocab_size=sizes.vocab_size,
      d_model=sizes.d_model,
      d_kv=sizes.d_kv,
      d_ff=sizes.d_ff,
      num_layers=sizes.num_layers,
      num_sparse_encoder_layers=sizes.num_layers // 2,
      num_decoder_layers=1,
      num_heads=sizes.num_heads,
      num_experts=sizes.num_experts,
      expert_capacity=sizes.expert_capacity,
      relative_attention_num_buckets=sizes.buckets,
      relative_attention_max_distance=sizes.max_distance,
      dropout_rate=0.0,  # Opacus trains in train mode: no dropout, no jitter
      router_jitter_noise=0.0,
  )
  transformers.SwitchTransformersForConditionalGeneration(
      config
  ).save_pretrained(path)
  return path


def raptor_model(path: str, sizes: Sizes, seed: int = 0):
  """(classifier, params) from the checkpoint; LoRA B factors made non-zero."""
  module, params = models.from_pretrained(
      path,
      num_labels=2,
      lora_rank=sizes.lora_rank,
      lora_alpha=sizes.lora_alpha,
      attention_lora=True,
      expert_lora_layers=(sizes.expert_layer,),
  )
  flat = roles.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 7), len(flat))
  flat = {
      p: (0.05 * jax.random.normal(k, v.shape) if p.endswith('lora_b') else v)
      for k, (p, v) in zip(keys, sorted(flat.items()))
  }
  return module, roles.unflatten(flat)


# ---------------------------------------------------------------------------
# The torch side.


def _torch_modules(sizes: Sizes):
  """LoRA and masked-expert modules (torch imported only when used)."""
  import torch  # pylint: disable=import-outside-toplevel
  from torch import nn  # pylint: disable=import-outside-toplevel

  class LoRALinear(nn.Module):
    """Frozen base Linear + scale * B(A(x)) (A, B trainable nn.Linear)."""

    def __init__(self, base, a, b, scale):
      super().__init__()
      self.base, self.scale = base, scale
      self.lora_a = nn.Linear(a.shape[0], a.shape[1], bias=False)
      self.lora_b = nn.Linear(b.shape[0], b.shape[1], bias=False)
      with torch.no_grad():
        self.lora_a.weight.copy_(torch.tensor(np.asarray(a).T))
        self.lora_b.weight.copy_(torch.tensor(np.asarray(b).T))

    def forward(self, x):
      return self.base(x) + self.scale * self.lora_b(self.lora_a(x))

  class MaskedExperts(nn.Module):
    """Every expert (with LoRA on wi, wo) on every token, masked by routing."""

    def __init__(self, sparse, wi, wo, scale):
      super().__init__()
      self.router, self.experts = sparse.router, sparse.experts
      self.wi = nn.ModuleList(
          LoRALinear(self.experts[f'expert_{e}'].wi, a, b, scale)
          for e, (a, b) in enumerate(zip(*wi))
      )
      self.wo = nn.ModuleList(
          LoRALinear(self.experts[f'expert_{e}'].wo, a, b, scale)
          for e, (a, b) in enumerate(zip(*wo))
      )

    def forward(self, x):
      selected, weights, _ = self.router(x)
      selected = selected.to(x.dtype)
      out = 0.0
      for e, (wi, wo) in enumerate(zip(self.wi, self.wo)):
        out = out + selected[..., e : e + 1] * wo(torch.relu(wi(x)))
      return out * weights

  class Classifier(nn.Module):
    """Encoder, mean pooling over real tokens, linear head."""

    def __init__(self, encoder, kernel, bias):
      super().__init__()
      self.encoder = encoder
      self.head = nn.Linear(kernel.shape[0], kernel.shape[1])
      with torch.no_grad():
        self.head.weight.copy_(torch.tensor(np.asarray(kernel).T))
        self.head.bias.copy_(torch.tensor(np.asarray(bias)))

    def forward(self, ids, mask):
      hidden = self.encoder(input_ids=ids, attention_mask=mask)
      m = mask.to(hidden.last_hidden_state.dtype)[..., None]
      pooled = (hidden.last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1.0)
      return self.head(pooled)

  return LoRALinear, MaskedExperts, Classifier


def torch_model(path: str, sizes: Sizes, params, stream: str):
  """The torch classifier with raptor_jax's weights; trainable per `stream`.

  'shared': LoRA on q, k, v, o (trainable) + the head; l*'s expert adapters
  merged into its frozen expert weights (same function). 'expert': LoRA on
  every expert of l* (trainable, masked dispatch); attention adapters merged
  into q, k, v, o, the head frozen.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  LoRALinear, MaskedExperts, Classifier = _torch_modules(sizes)
  flat = {p: np.asarray(v) for p, v in roles.flatten(params).items()}
  scale = sizes.lora_alpha / sizes.lora_rank
  encoder = transformers.SwitchTransformersEncoderModel.from_pretrained(path)
  encoder = encoder.float()
  for p in encoder.parameters():
    p.requires_grad_(False)
  for i, block in enumerate(encoder.encoder.block):
    attn = block.layer[0].SelfAttention
    for name in 'qkvo':
      a, b = (
          flat[f'backbone/block_{i}/attention/{name}/lora_{x}'] for x in 'ab'
      )
      base = getattr(attn, name)
      if stream == 'shared':
        setattr(attn, name, LoRALinear(base, a, b, scale))
      else:
        with torch.no_grad():
          base.weight.add_(torch.tensor(scale * (a @ b).T))
  prefix = f'backbone/block_{sizes.expert_layer}/mlp/experts'
  factors = {
      m: (flat[f'{prefix}/{m}/lora_a'], flat[f'{prefix}/{m}/lora_b'])
      for m in ('wi', 'wo')
  }
  ff = encoder.encoder.block[sizes.expert_layer].layer[1]
  if stream == 'shared':
    for e in range(sizes.num_experts):
      for m, (a, b) in factors.items():
        weight = getattr(ff.mlp.experts[f'expert_{e}'], m).weight
        with torch.no_grad():
          weight.add_(torch.tensor(scale * (a[e] @ b[e]).T))
  else:
    ff.mlp = MaskedExperts(ff.mlp, factors['wi'], factors['wo'], scale)
  # Train mode (Opacus requires it) is eval mode here: dropout and jitter are 0.
  model = Classifier(encoder, flat['head/kernel'], flat['head/bias']).train()
  model.head.requires_grad_(stream == 'shared')
  return model


def torch_grads(model) -> dict[str, np.ndarray]:
  """{raptor path: gradient} of the torch model's trainable parameters."""
  out = {}
  for name, p in model.named_parameters():
    if not p.requires_grad or p.grad is None:
      continue
    out[_raptor_path(name)] = _raptor_layout(name, p.grad.detach().numpy())
  return out


def _raptor_path(name: str) -> str:
  """torch parameter name -> raptor_jax path (attention and expert LoRA, head)."""
  parts = name.replace('_module.', '').split('.')
  if parts[0] == 'head':
    return {'weight': 'head/kernel', 'bias': 'head/bias'}[parts[1]]
  block = parts[parts.index('block') + 1]
  leaf = parts[-2]  # lora_a | lora_b
  if 'SelfAttention' in parts:
    proj = parts[parts.index('SelfAttention') + 1]
    return f'backbone/block_{block}/attention/{proj}/{leaf}'
  matrix, expert = parts[-4], parts[-3]
  return f'backbone/block_{block}/mlp/experts/{matrix}/{leaf}#{expert}'


def _raptor_layout(name: str, g: np.ndarray) -> np.ndarray:
  """torch Linear weights are [out, in]; raptor_jax's are [in, out]."""
  return g.T if g.ndim == 2 else g


def stack_experts(tree: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """'path#e' leaves (expert e of a ModuleList) -> one [E, ...] leaf per path."""
  out, experts = {}, {}
  for path, g in tree.items():
    base, sep, e = path.partition('#')
    if sep:
      experts.setdefault(base, {})[int(e)] = g
    else:
      out[path] = g
  out.update(
      {p: np.stack([g[e] for e in sorted(g)]) for p, g in experts.items()}
  )
  return out


def relative_error(ours: dict, theirs: dict) -> float:
  """||a - b|| / ||b|| over every leaf (same keys required)."""
  if set(ours) != set(theirs):
    raise ValueError(f'different leaves: {sorted(set(ours) ^ set(theirs))}')
  diff = sum(
      float(np.sum((np.asarray(ours[p]) - theirs[p]) ** 2)) for p in theirs
  )
  norm = sum(float(np.sum(np.asarray(theirs[p]) ** 2)) for p in theirs)
  return float(np.sqrt(diff / max(norm, 1e-30)))


# ---------------------------------------------------------------------------
# Steps: zero-argument callables, and each side's update with the noise off.


def records(sizes: Sizes, m: int, seed: int):
  """((ids, mask, labels), owners) as jax arrays, right-padded."""
  return benchmark.batch(
      m, sizes.seq_len, sizes.vocab_size, sizes.num_experts, seed=seed
  )


def _torch_batch(batch):
  import torch  # pylint: disable=import-outside-toplevel

  return tuple(torch.tensor(np.asarray(x)).long() for x in batch)


def torch_nonprivate(model, batch):
  """(step, mean-loss gradients): backward + Adam, as plain PyTorch trains."""
  import torch  # pylint: disable=import-outside-toplevel

  ids, mask, labels = _torch_batch(batch)
  trainable = [p for p in model.parameters() if p.requires_grad]
  adam = torch.optim.Adam(trainable, lr=benchmark.LEARNING_RATE)

  def backward():
    adam.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(ids, mask), labels)
    loss.backward()

  def step():
    backward()
    adam.step()

  backward()
  grads = torch_grads(model)
  adam.zero_grad(set_to_none=True)
  return step, grads


def opacus_dp(model, batch, mode: str, noise_multiplier: float):
  """(step, update with noise off, the wrapped model) of Opacus's DP-Adam.

  Flat clipping at L2_CLIP, mean loss (Opacus's usual setting), expected
  batch size m: the update is (sum of clipped + noise) / m, raptor_jax's
  denominator.
  """
  import torch  # pylint: disable=import-outside-toplevel
  from opacus import PrivacyEngine  # pylint: disable=import-outside-toplevel

  ids, mask, labels = _torch_batch(batch)
  m = len(labels)
  trainable = [p for p in model.parameters() if p.requires_grad]
  adam = torch.optim.Adam(trainable, lr=benchmark.LEARNING_RATE)
  loader = torch.utils.data.DataLoader(
      torch.utils.data.TensorDataset(torch.zeros(m)), batch_size=m
  )
  criterion = torch.nn.CrossEntropyLoss()
  out = PrivacyEngine(accountant='rdp').make_private(
      module=model,
      optimizer=adam,
      data_loader=loader,
      criterion=criterion,
      noise_multiplier=noise_multiplier,
      max_grad_norm=L2_CLIP,
      loss_reduction='mean',
      poisson_sampling=False,
      grad_sample_mode=mode,
  )
  dp_model, dp_opt = out[0], out[1]
  if mode == 'ghost':
    criterion = out[2]

  def backward():
    dp_opt.zero_grad(set_to_none=True)
    criterion(dp_model(ids, mask), labels).backward()

  def step():
    backward()
    dp_opt.step()

  def update_without_noise():
    dp_opt.noise_multiplier, sigma = 0.0, dp_opt.noise_multiplier
    backward()
    dp_opt.pre_step()
    grads = torch_grads(model)
    dp_opt.noise_multiplier = sigma
    dp_opt.zero_grad(set_to_none=True)
    return grads

  return step, update_without_noise, dp_model


def owner_reference(model, dp_model, batch, owners, sizes: Sizes):
  """Expert-stream reference from Opacus's per-sample gradients (hooks mode).

  Record i's contribution: the owner's rows of its every-expert gradient,
  times w_i = 1 - p(y_i) of the model with l*'s B factors at zero (the
  trainer's 'shared' residual weight), clipped to L2_CLIP, added into row
  owner_i. Returns {path: [E, ...]} / (m / E), raptor_jax's update.
  """
  import torch  # pylint: disable=import-outside-toplevel

  ids, mask, labels = _torch_batch(batch)
  owners = np.asarray(owners)
  b_factors = [p for n, p in model.named_parameters() if 'lora_b' in n]
  saved = [p.detach().clone() for p in b_factors]
  with torch.no_grad():
    for p in b_factors:
      p.zero_()
    probs = torch.softmax(model(ids, mask), -1)
    for p, s in zip(b_factors, saved):
      p.copy_(s)
  weights = (1.0 - probs[torch.arange(len(labels)), labels]).numpy()
  dp_model.zero_grad(set_to_none=True)
  torch.nn.functional.cross_entropy(dp_model(ids, mask), labels).backward()
  # Opacus (loss_reduction='mean') scales grad_sample back to each record's own.
  per_sample = {}
  for name, p in model.named_parameters():
    if p.requires_grad:
      g = p.grad_sample.detach().numpy()
      per_sample[_raptor_path(name)] = np.swapaxes(g, 1, 2)
  e_axis = {p.partition('#')[0]: None for p in per_sample}
  sums = {
      p: np.zeros((sizes.num_experts,) + per_sample[f'{p}#0'].shape[1:])
      for p in e_axis
  }
  for i, owner in enumerate(owners):
    own = {p: weights[i] * per_sample[f'{p}#{owner}'][i] for p in e_axis}
    norm = np.sqrt(sum(float(np.sum(g**2)) for g in own.values()))
    factor = min(1.0, L2_CLIP / max(norm, 1e-30))
    for p, g in own.items():
      sums[p][owner] += factor * g
  dp_model.zero_grad(set_to_none=True)
  return {p: s / (len(owners) / sizes.num_experts) for p, s in sums.items()}


def raptor_nonprivate(module, params, batch):
  """(step, mean-loss gradients) of the trainer's non-private step.

  The PhaseStep of a non-private phase (the trainer's non-private LoRA
  baseline): the gradient of the summed loss over the attention adapters
  and the head, divided by the microbatch size, then Adam.
  """
  return raptor_dp(module, params, batch, None, None, 'nonprivate')


def phase_step(module, params, sizes: Sizes, stream: str, batch_size: float):
  """(PhaseStep, its state): the trainer's step for `stream` on every device.

  `stream` is 'shared' or 'expert' (the DP steps, clip L2_CLIP) or
  'nonprivate'; `batch_size` is the expected batch (the public denominator
  is it, or it over E for the expert stream), on a mesh of every device
  (one per core on CPU, see `raptor_jax.host_devices`).
  """
  from raptor_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  extra = {}
  if stream == 'expert':
    phase = benchmark.one_part_phase(
        'expert',
        roles.EXPERT_ROLES,
        denominator=batch_size / sizes.num_experts,
        blocks=(sizes.expert_layer,),
        owner=True,
        residual=True,
    )
    extra = dict(expert_layer=sizes.expert_layer, residual='shared')
  else:
    phase = benchmark.one_part_phase(
        'shared', roles.SHARED_ROLES, denominator=float(batch_size)
    )
  private = stream != 'nonprivate'
  phase = dataclasses.replace(
      phase,
      private=private,
      parts=tuple(
          dataclasses.replace(
              p,
              l2_clip=L2_CLIP,
              noise_multiplier=p.noise_multiplier if private else 0.0,
          )
          for p in phase.parts
      ),
  )
  dp = step_lib.PhaseStep(
      module,
      phase,
      key=jax.random.key(0),
      learning_rate=benchmark.LEARNING_RATE,
      mesh=parallel.make_mesh(0),
      **extra,
  )
  return dp, dp.init(params)


def host_batch(ids, mask, labels, owners=None) -> dict:
  """The trainer's host batch of one microbatch (owners zero when unused)."""
  return {
      'input_ids': ids,
      'attention_mask': mask,
      'labels': labels,
      'owners': jnp.zeros_like(labels) if owners is None else owners,
  }


def raptor_dp(module, params, batch, owners, sizes: Sizes, stream: str):
  """(step, update with noise off) of the trainer's PhaseStep for `stream`.

  One microbatch of m records is the whole expected batch (`phase_step`
  with batch size m). The step is `accumulate` (per-record clipped sums, or
  the summed gradient) then `update` (noise once, public denominator,
  Adam), as the trainer runs one microbatch; the update without noise is
  accumulate's sums over the denominator.
  """
  m = len(batch[2])
  devices = parallel.make_mesh(0).size
  if m % devices:
    raise ValueError(
        f'microbatch {m} is not a multiple of the {devices} devices; '
        'choose --microbatch_sizes divisible by it (or --cpu_devices=1)'
    )
  dp, state = phase_step(module, params, sizes, stream, m)
  host = host_batch(*batch, owners)
  sums = dp.accumulate(state, dp.zero_sums(state), host)
  (part,) = dp.phase.parts
  update = {
      p: np.asarray(v) / part.denominator for p, v in sums[part.name].items()
  }

  def step():
    return dp.update(state, dp.accumulate(state, dp.zero_sums(state), host))

  return step, update


# ---------------------------------------------------------------------------
# Timing each side in its own process.

RAPTOR_COLUMNS = ('raptor', 'raptor DP', 'raptor expert')


def side_calls(side: str, path: str, sizes: Sizes, m: int, modes):
  """({column: zero-argument step}, {column: error line}) of one side.

  'raptor': the trainer's non-private, shared DP and expert steps; 'torch':
  torch's non-private step and Opacus's shared and expert DP steps per mode
  (a mode that fails is reported, not timed). Both build the same model and
  records as `compare`.
  """
  module, params = raptor_model(path, sizes)
  batch, owners = records(sizes, m, seed=m)
  if side == 'raptor':
    calls = {
        'raptor': raptor_nonprivate(module, params, batch)[0],
        'raptor DP': raptor_dp(module, params, batch, owners, sizes, 'shared')[
            0
        ],
        'raptor expert': raptor_dp(
            module, params, batch, owners, sizes, 'expert'
        )[0],
    }
    return calls, {}
  calls = {
      'torch': torch_nonprivate(
          torch_model(path, sizes, params, 'shared'), batch
      )[0]
  }
  failed = {}
  for mode in modes:
    for stream in ('shared', 'expert'):
      column = f'opacus {mode}' + (' expert' if stream == 'expert' else '')
      try:
        calls[column] = opacus_dp(
            torch_model(path, sizes, params, stream),
            batch,
            mode,
            benchmark.NOISE_MULTIPLIER,
        )[0]
      except Exception as e:  # pylint: disable=broad-except
        failed[column] = f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'
  return calls, failed


def serve(side: str, path: str, sizes: Sizes, m: int, modes) -> None:
  """Worker loop (`harness.serve`) of one side's `side_calls`."""
  calls, failed = side_calls(side, path, sizes, m, modes)
  harness.serve({c: (lambda r, f=f: f()) for c, f in calls.items()}, failed)


def tagged(column: str, tag: str) -> str:
  """'opacus ew expert', 'keep' -> 'opacus+keep ew expert' (tag '' keeps it)."""
  if not tag:
    return column
  first, _, rest = column.partition(' ')
  return f'{first}+{tag}' + (f' {rest}' if rest else '')


def worker_times(path: str, m: int, workers, *, repeats: int, flag_args):
  """({column: [seconds per round]}, {column: error}) from worker processes.

  `workers`: (side, host_memory) pairs, host_memory 'keep' or 'glibc'. Each
  worker is this script with `--serve`, building its side from the saved
  checkpoint at `path` (`flag_args`: the sizes, modes, threading flags),
  timed by `harness.worker_times`. torch workers' columns are tagged with a
  'keep' setting (`tagged`); the raptor_jax worker always keeps host
  memory, as launch/main.py does.
  """
  commands = []
  for side, memory in workers:
    keep = side == 'raptor' or memory == 'keep'
    argv = [
        sys.executable,
        '-m',
        'launch.bench.vs_opacus',
        f'--serve={side}',
        f'--model_path={path}',
        f'--microbatch_sizes={m}',
        '--keep_host_memory' if keep else '--nokeep_host_memory',
        *flag_args,
    ]
    tag = 'keep' if side == 'torch' and keep else ''
    commands.append((argv, lambda c, tag=tag: tagged(c, tag)))
  return harness.worker_times(commands, repeats=repeats)


# ---------------------------------------------------------------------------
# One microbatch size: check, then time everything in interleaved rounds.


def _check(name: str, ours: dict, theirs: dict, tolerance: float, errors):
  err = relative_error(ours, theirs)
  errors[name] = err
  if not err <= tolerance:
    raise AssertionError(
        f'{name}: raptor_jax and torch updates differ by {err:.2e} '
        f'(relative) > {tolerance:.0e}'
    )


def compare(
    path,
    sizes,
    module,
    params,
    m,
    *,
    modes,
    repeats,
    tolerance,
    fp32_tolerance=1e-2,
    workers=(),
    flag_args=(),
):
  """One row: checks both sides' updates, then interleaved timings.

  raptor_jax (float32) is checked against torch in float64 (the non-private
  gradient, Opacus hooks' clipped mean, the owner sums from its per-sample
  gradients) to `tolerance`, and against each float32 torch step to
  `fp32_tolerance` (torch's own float32 error is printed as the yardstick).
  The steps are then timed here, or, given `workers` ((side, host memory)
  pairs), in worker processes (`worker_times`, with `flag_args`).

  Returns {'m', 'errors': {pair: rel err}, 'ms': {column: median ms},
  'times': {column: [s per round]}, 'failed': {column: error line}}.
  """
  batch, owners = records(sizes, m, seed=m)
  errors, calls, failed = {}, {}, {}
  exact = lambda stream: torch_model(path, sizes, params, stream).double()
  calls['raptor'], grads = raptor_nonprivate(module, params, batch)
  calls['torch'], theirs = torch_nonprivate(
      torch_model(path, sizes, params, 'shared'), batch
  )
  _, grads64 = torch_nonprivate(exact('shared'), batch)
  errors['torch float32 vs float64'] = relative_error(theirs, grads64)
  _check('non-private vs torch64', grads, grads64, tolerance, errors)
  _check('non-private vs torch', grads, theirs, fp32_tolerance, errors)
  calls['raptor DP'], update = raptor_dp(
      module, params, batch, owners, sizes, 'shared'
  )
  _, no_noise64, _ = opacus_dp(exact('shared'), batch, 'hooks', 0.0)
  _check('DP vs opacus64', update, no_noise64(), tolerance, errors)
  calls['raptor expert'], expert_update = raptor_dp(
      module, params, batch, owners, sizes, 'expert'
  )
  model64 = exact('expert')
  _, _, dp_model64 = opacus_dp(model64, batch, 'hooks', 0.0)
  reference = owner_reference(model64, dp_model64, batch, owners, sizes)
  _check('expert vs opacus64', expert_update, reference, tolerance, errors)
  for mode in modes:
    for stream in ('shared', 'expert'):
      column = f'opacus {mode}' + (' expert' if stream == 'expert' else '')
      try:
        model = torch_model(path, sizes, params, stream)
        calls[column], no_noise, _ = opacus_dp(
            model, batch, mode, benchmark.NOISE_MULTIPLIER
        )
        if stream == 'shared':
          _check(f'DP vs {column}', update, no_noise(), fp32_tolerance, errors)
      except AssertionError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        failed[column] = f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'
        calls.pop(column, None)
  times = {}  # repeats=0: the checks only (no step is compiled or timed)
  if repeats and workers:
    del calls  # timed in the workers; free this process's buffers first
    times, failed = worker_times(
        path, m, workers, repeats=repeats, flag_args=flag_args
    )
  elif repeats:
    times = profiling.interleaved_times(calls, repeats=repeats)
  ms = {c: profiling.median(t) * 1e3 for c, t in times.items()}
  return dict(m=m, errors=errors, ms=ms, times=times, failed=failed)


def _fastest(row, framework: str, expert: bool = False) -> str:
  """The fastest column of `framework` ('torch', 'opacus'), any mode and tag.

  Columns are '<framework>[+keep] [<mode>][ expert]' (see `tagged`).
  """
  columns = [
      c
      for c in row['ms']
      if c.split()[0].split('+')[0] == framework
      and c.endswith(' expert') == expert
  ]
  return min(columns, key=row['ms'].get)


def _label(column: str) -> str:
  """'opacus+keep ew expert' -> 'ew, keep'; 'torch' -> ''."""
  first, *rest = column.split()
  words = [w for w in rest if w != 'expert'] + first.split('+')[1:]
  return ', '.join(words)


def summary(row) -> dict:
  """The table's columns and paired ratios of one row."""
  t, ms = row['times'], row['ms']
  torch = _fastest(row, 'torch')
  shared, expert = _fastest(row, 'opacus'), _fastest(row, 'opacus', True)
  ratio = profiling.paired_ratio
  return {
      'm': row['m'],
      'torch': ms[torch],
      'torch mode': _label(torch),
      'opacus': ms[shared],
      'opacus mode': _label(shared),
      'raptor': ms['raptor'],
      'raptor DP': ms['raptor DP'],
      'opacus expert': ms[expert],
      'opacus expert mode': _label(expert),
      'raptor expert': ms['raptor expert'],
      'raptor/torch': ratio(t['raptor'], t[torch]),
      'opacus/raptor DP': ratio(t[shared], t['raptor DP']),
      'opacus expert/raptor expert': ratio(t[expert], t['raptor expert']),
      'raptor DP/raptor': ratio(t['raptor DP'], t['raptor']),
  }


def tables(rows) -> str:
  """The main table, the ratios, every Opacus mode and the update checks."""
  s = [summary(r) for r in rows]
  main = profiling.format_table(
      [
          'microbatch',
          'torch non-private (setting)',
          'Opacus shared DP (mode)',
          'raptor_jax non-private',
          'raptor_jax shared DP',
          'Opacus expert stream (mode)',
          'raptor_jax expert stream',
      ],
      [
          [
              r['m'],
              f"{r['torch']:.0f}"
              + (f" ({r['torch mode']})" * bool(r['torch mode'])),
              f"{r['opacus']:.0f} ({r['opacus mode']})",
              f"{r['raptor']:.0f}",
              f"{r['raptor DP']:.0f}",
              f"{r['opacus expert']:.0f} ({r['opacus expert mode']})",
              f"{r['raptor expert']:.0f}",
          ]
          for r in s
      ],
  )
  names = [
      'raptor/torch',
      'opacus/raptor DP',
      'opacus expert/raptor expert',
      'raptor DP/raptor',
  ]
  ratios = profiling.format_table(
      ['microbatch'] + names,
      [[r['m']] + [f'{r[n]:.2f}' for n in names] for r in s],
  )
  columns = sorted(
      {c for r in rows for c in r['ms'] if not c.startswith('raptor')}
  )
  modes = profiling.format_table(
      ['column'] + [f"m={r['m']}" for r in rows],
      [
          [c] + [f"{r['ms'].get(c, float('nan')):.0f}" for r in rows]
          for c in columns
      ],
  )
  checks = profiling.format_table(
      ['microbatch'] + sorted(rows[0]['errors']),
      [
          [r['m']] + [f'{r["errors"][k]:.1e}' for k in sorted(r['errors'])]
          for r in rows
      ],
  )
  failed = [
      f"  m={r['m']} {c}: {e}" for r in rows for c, e in r['failed'].items()
  ]
  return '\n'.join(
      [
          'Median step ms (interleaved rounds)',
          main,
          '\nPaired ratios (median over rounds of a / b)',
          ratios,
          '\nEvery torch-side step, by Opacus grad_sample_mode and host memory'
          ' (+keep: keep_freed_memory) (median ms)',
          modes,
          '\nUpdate checks, noise off: ||a - b|| / ||b|| (64: torch in float64)',
          checks,
      ]
      + (['\nModes that failed:'] + failed if failed else [])
  )


def run(
    sizes: Sizes,
    microbatch_sizes,
    *,
    modes=MODES,
    repeats=5,
    tolerance=1e-3,
    fp32_tolerance=1e-2,
    threads=2,
    workers=(),
    flag_args=(),
    verbose=False,
):
  """Saves the model, loads it into both sides, one `compare` row per m."""
  import torch  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(threads)
  with tempfile.TemporaryDirectory() as tmp:
    path = save_switch(os.path.join(tmp, 'switch'), sizes)
    module, params = raptor_model(path, sizes)
    rows = []
    for m in microbatch_sizes:
      rows.append(
          compare(
              path,
              sizes,
              module,
              params,
              m,
              modes=modes,
              repeats=repeats,
              tolerance=tolerance,
              fp32_tolerance=fp32_tolerance,
              workers=workers,
              flag_args=flag_args,
          )
      )
      if verbose:  # a long run shows each row as it finishes
        print(f'm={m}:', {c: round(t) for c, t in rows[-1]['ms'].items()})
        print(f'm={m} checks:', rows[-1]['errors'], flush=True)
    return rows


def cpu_device_count(requested: int, microbatch_sizes) -> int:
  """--cpu_devices, or for 0 the most devices, up to one per core, that
  divide every microbatch size (each device takes an equal share)."""
  return requested or host_devices.dividing_count(microbatch_sizes)


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  bad = sorted(set(FLAGS.torch_host_memory) - {'glibc', 'keep'})
  if bad or not FLAGS.torch_host_memory:
    sys.exit(
        'error: --torch_host_memory takes glibc and/or keep, got '
        f'{bad or "nothing"}'
    )
  worker = bool(FLAGS.serve)
  kept = FLAGS.keep_host_memory  # set before the imports, see the top
  if FLAGS.omp == 'passive':
    os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'  # before torch's OpenMP starts
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  transformers.logging.set_verbosity_error()
  transformers.logging.disable_progress_bar()
  sizes = QUICK if FLAGS.quick else Sizes()
  devices = cpu_device_count(
      FLAGS.cpu_devices,
      [2] if FLAGS.quick else [int(m) for m in FLAGS.microbatch_sizes],
  )
  devices = host_devices.one_device_per_core(devices)
  sizes_m = [int(m) for m in FLAGS.microbatch_sizes]
  if FLAGS.quick and not worker:
    sizes_m = [2 * devices]
  if worker:
    torch.set_num_threads(FLAGS.threads)
    serve(FLAGS.serve, FLAGS.model_path, sizes, sizes_m[0], FLAGS.modes)
    return
  workers, flag_args = (), ()
  if FLAGS.isolate:
    workers = (('raptor', 'keep'),) + tuple(
        ('torch', memory) for memory in FLAGS.torch_host_memory
    )
    flag_args = (
        f'--modes={",".join(FLAGS.modes)}',
        f'--threads={FLAGS.threads}',
        f'--omp={FLAGS.omp}',
        f'--cpu_devices={devices}',
    ) + (('--quick',) if FLAGS.quick else ())
    memory = (
        'raptor_jax worker: host memory kept (as launch/main.py); torch '
        f'workers: {", ".join(FLAGS.torch_host_memory)}'
    )
  else:
    memory = (
        f"one process; host memory {'kept' if kept else 'returned each step'}"
    )
  print(
      f'Switch d_model={sizes.d_model} blocks={sizes.num_layers} (sparse every '
      f'2nd, l*={sizes.expert_layer}) E={sizes.num_experts} d_ff={sizes.d_ff} '
      f'seq={sizes.seq_len} LoRA r={sizes.lora_rank}; torch {torch.__version__} '
      f'{FLAGS.threads} threads, OMP_WAIT_POLICY='
      f"{os.environ.get('OMP_WAIT_POLICY', '(default)')}; jax {jax.__version__} "
      f'{jax.devices()[0].platform} x {devices} devices, '
      f'{host_devices.host_cores()} cores; clip {L2_CLIP}, sigma '
      f'{benchmark.NOISE_MULTIPLIER}; {memory}',
      flush=True,
  )
  rows = run(
      sizes,
      sizes_m,
      modes=FLAGS.modes,
      repeats=1 if FLAGS.quick else FLAGS.repeats,
      tolerance=FLAGS.tolerance,
      fp32_tolerance=FLAGS.fp32_tolerance,
      threads=FLAGS.threads,
      workers=workers,
      flag_args=flag_args,
      verbose=True,
  )
  print(tables(rows))


if __name__ == '__main__':
  define_flags()
  app.run(main)
