"""The PyTorch + Opacus side of `vs_opacus` and `epoch_time` (torch is
imported only when a function is called).

`torch_model`: the saved HF Switch encoder with LoRA, mean pooling and a
linear head, on raptor_jax's weights. Steps: plain PyTorch (`torch_step`)
and Opacus's DP-Adam with flat clipping (`opacus_private`, `opacus_step`).
References the updates are checked against: `torch_grads`, `opacus_dp`'s
noiseless update, `owner_reference`; `relative_error` compares two trees.
"""

from __future__ import annotations

import numpy as np

from launch.bench import builders
from raptor_jax import roles

L2_CLIP = builders.HF_L2_CLIP


def _torch_modules():
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
      expert = lambda e, m: getattr(self.experts[f'expert_{e}'], m)
      self.wi, self.wo = (
          nn.ModuleList(
              LoRALinear(expert(e, m), a, b, scale)
              for e, (a, b) in enumerate(zip(*factors))
          )
          for m, factors in (('wi', wi), ('wo', wo))
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


def torch_model(path: str, sizes: builders.Sizes, params, stream: str):
  """The torch classifier with raptor_jax's weights. Trainable: 'shared',
  LoRA on q, k, v, o and the head (l*'s expert adapters merged into its
  frozen experts); 'expert', LoRA on every expert of l* (masked dispatch;
  attention adapters merged, the head frozen)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  transformers.logging.set_verbosity_error()  # not its encoder-only report
  transformers.logging.disable_progress_bar()
  LoRALinear, MaskedExperts, Classifier = _torch_modules()
  flat = {p: np.asarray(v) for p, v in roles.flatten(params).items()}
  scale = sizes.lora_alpha / sizes.lora_rank
  encoder = transformers.SwitchTransformersEncoderModel.from_pretrained(path)
  encoder = encoder.float()
  for p in encoder.parameters():
    p.requires_grad_(False)
  for i, block in enumerate(encoder.encoder.block):
    attn = block.layer[0].SelfAttention
    for name in 'qkvo':
      path = f'backbone/block_{i}/attention/{name}/lora_'
      a, b, base = flat[path + 'a'], flat[path + 'b'], getattr(attn, name)
      if stream == 'shared':
        setattr(attn, name, LoRALinear(base, a, b, scale))
      else:
        with torch.no_grad():
          base.weight.add_(torch.tensor(scale * (a @ b).T))
  prefix = f'backbone/block_{sizes.expert_layer}/mlp/experts'
  factors = {
      m: [flat[f'{prefix}/{m}/lora_{x}'] for x in 'ab'] for m in ('wi', 'wo')
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


def torch_grads(model, attr: str = 'grad') -> dict[str, np.ndarray]:
  """{raptor path: `attr` of p} of the trainable parameters, [in, out] as
  raptor_jax's kernels (`attr`: 'grad', or Opacus's 'summed_grad')."""
  out = {}
  for name, p in model.named_parameters():
    g = getattr(p, attr, None) if p.requires_grad else None
    if g is not None:
      g = g.detach().numpy()
      out[_raptor_path(name)] = g.T if g.ndim == 2 else g
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


def relative_error(ours: dict, theirs: dict) -> float:
  """||a - b|| / ||b|| over every leaf (same keys required)."""
  if set(ours) != set(theirs):
    raise ValueError(f'different leaves: {sorted(set(ours) ^ set(theirs))}')
  diff = sum(
      float(np.sum((np.asarray(ours[p]) - theirs[p]) ** 2)) for p in theirs
  )
  norm = sum(float(np.sum(np.asarray(theirs[p]) ** 2)) for p in theirs)
  return float(np.sqrt(diff / max(norm, 1e-30)))


def check(errors: dict, name: str, ours, theirs, tolerance: float) -> None:
  """errors[name] = `relative_error(ours, theirs)`; raises past `tolerance`."""
  errors[name] = err = relative_error(ours, theirs)
  if not err <= tolerance:
    raise AssertionError(
        f'{name}: the updates differ by {err:.2e} (relative) > {tolerance:.0e}'
    )


# ---------------------------------------------------------------------------
# Steps: call(r) runs step r of `batches`, a list of microbatch lists.


def torch_batch(arrays):
  """(ids, mask, labels) arrays -> torch int64 tensors."""
  import torch  # pylint: disable=import-outside-toplevel

  return tuple(torch.tensor(np.asarray(x)).long() for x in arrays)


def _adam(model):
  import torch  # pylint: disable=import-outside-toplevel

  trainable = [p for p in model.parameters() if p.requires_grad]
  return torch.optim.Adam(trainable, lr=builders.LEARNING_RATE)


def torch_step(model, batches, reduction: str = 'sum'):
  """(call(r), backward(r)): plain PyTorch's step r, gradient accumulation
  over its microbatches (loss `reduction`), then Adam; backward(r) stops
  before Adam, leaving the gradients in p.grad."""
  import torch  # pylint: disable=import-outside-toplevel

  adam = _adam(model)

  def backward(r):
    adam.zero_grad(set_to_none=True)
    for ids, mask, labels in batches[r]:
      torch.nn.functional.cross_entropy(
          model(ids, mask), labels, reduction=reduction
      ).backward()

  def call(r):
    backward(r)
    adam.step()

  return call, backward


def torch_nonprivate(model, batch):
  """(step, mean-loss gradients) of one microbatch: backward + Adam."""
  call, backward = torch_step(model, [[torch_batch(batch)]], 'mean')
  backward(0)
  return (lambda: call(0)), torch_grads(model)


def opacus_private(
    model,
    mode: str,
    expected_batch: int,
    noise_multiplier: float = builders.NOISE_MULTIPLIER,
):
  """(dp_model, dp_optimizer, criterion): Opacus DP-Adam, flat clip at
  L2_CLIP, mean loss over `expected_batch` (raptor_jax's denominator);
  `criterion` the mean cross-entropy ('ghost': Opacus's wrapper of it)."""
  import torch  # pylint: disable=import-outside-toplevel
  from opacus import PrivacyEngine  # pylint: disable=import-outside-toplevel

  loader = torch.utils.data.DataLoader(
      torch.utils.data.TensorDataset(torch.zeros(expected_batch)),
      batch_size=expected_batch,
  )
  criterion = torch.nn.CrossEntropyLoss()
  out = PrivacyEngine(accountant='rdp').make_private(
      module=model,
      optimizer=_adam(model),
      data_loader=loader,
      criterion=criterion,
      noise_multiplier=noise_multiplier,
      max_grad_norm=L2_CLIP,
      loss_reduction='mean',
      poisson_sampling=False,
      grad_sample_mode=mode,
  )
  return out[0], out[1], out[2] if mode == 'ghost' else criterion


def opacus_step(dp_model, dp_opt, criterion, batches):
  """call(r): step r as BatchMemoryManager runs it (skip all but the last)."""

  def call(r):
    mbs = batches[r]
    for i, (ids, mask, labels) in enumerate(mbs):
      dp_opt.zero_grad(set_to_none=True)
      criterion(dp_model(ids, mask), labels).backward()
      dp_opt.signal_skip_step(do_skip=i < len(mbs) - 1)
      dp_opt.step()

  return call


def opacus_dp(model, batch, mode: str, noise_multiplier: float):
  """(step, update with noise off, the wrapped model) of Opacus's DP-Adam
  on one microbatch of m records, the expected batch (`opacus_private`)."""
  ids, mask, labels = torch_batch(batch)
  dp_model, dp_opt, criterion = opacus_private(
      model, mode, len(labels), noise_multiplier
  )
  step = opacus_step(dp_model, dp_opt, criterion, [[(ids, mask, labels)]])

  def update_without_noise():
    dp_opt.noise_multiplier, sigma = 0.0, dp_opt.noise_multiplier
    dp_opt.zero_grad(set_to_none=True)
    criterion(dp_model(ids, mask), labels).backward()
    dp_opt.pre_step()
    grads = torch_grads(model)
    dp_opt.noise_multiplier = sigma
    dp_opt.zero_grad(set_to_none=True)
    return grads

  return (lambda: step(0)), update_without_noise, dp_model


def owner_reference(model, dp_model, batch, owners, sizes: builders.Sizes):
  """The expert stream's update {path: [E, ...]} from Opacus's per-sample
  gradients (hooks): record i adds the owner's rows of its gradient, times
  w_i = 1 - p(y_i) with l*'s B factors at zero (the 'shared' residual
  weight), clipped to L2_CLIP, into row owner_i; all over m / E."""
  import torch  # pylint: disable=import-outside-toplevel

  ids, mask, labels = torch_batch(batch)
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


def float64_references(path, sizes: builders.Sizes, params, batch, owners):
  """{'nonprivate', 'shared', 'expert'}: torch's noiseless updates in
  float64 (`torch_nonprivate`, `opacus_dp` hooks, `owner_reference`)."""
  exact = lambda stream: torch_model(path, sizes, params, stream).double()
  model64 = exact('expert')
  _, _, dp_model64 = opacus_dp(model64, batch, 'hooks', 0.0)
  return {
      'nonprivate': torch_nonprivate(exact('shared'), batch)[1],
      'shared': opacus_dp(exact('shared'), batch, 'hooks', 0.0)[1](),
      'expert': owner_reference(model64, dp_model64, batch, owners, sizes),
  }
