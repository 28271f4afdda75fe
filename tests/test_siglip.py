"""The SigLIP vision tower against transformers' SiglipVisionModel, in float64.

The reference is an independent implementation (transformers, q/k/v as three
projections); its tensors are renamed to DeepSeek-VL2's timm layout (`qkv`
fused, `pos_embed` [1, N, D]) by `hf_to_timm` below and loaded through the
port's own name table, so the table is checked too. The image side (30 px at
patch 7) leaves 2 pixel rows and columns outside the last patch, as 384 px at
patch 14 does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from raptor_jax.models import siglip

TOLERANCE = 1e-5  # relative (max |a - b| / max |b|), per tensor, float64
CONFIG = siglip.SiglipConfig(
    image_size=30, patch_size=7, width=24, layers=2, heads=4, mlp_dim=37
)


def hf_reference(config: siglip.SiglipConfig, seed=0):
  torch.manual_seed(seed)
  model = transformers.SiglipVisionModel(
      transformers.SiglipVisionConfig(
          hidden_size=config.width,
          intermediate_size=config.mlp_dim,
          num_hidden_layers=config.layers,
          num_attention_heads=config.heads,
          image_size=config.image_size,
          patch_size=config.patch_size,
          layer_norm_eps=config.layer_norm_eps,
          hidden_act="gelu_pytorch_tanh",
          vision_use_head=False,
          attn_implementation="sdpa",  # eager runs its softmax in float32
      )
  )
  # Random non-trivial norms and biases (the default init makes them 1 / 0).
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  return model.double().eval()


def hf_to_timm(tensors):
  """transformers SiglipVisionModel names -> DeepSeek-VL2's `vision.` names."""
  out = {}
  simple = {
      "embeddings.patch_embedding": "patch_embed.proj",
      "post_layernorm": "norm",
  }
  layers = {
      "layer_norm1": "norm1",
      "layer_norm2": "norm2",
      "self_attn.out_proj": "attn.proj",
      "mlp.fc1": "mlp.fc1",
      "mlp.fc2": "mlp.fc2",
  }
  tensors = {n.removeprefix("vision_model."): w for n, w in tensors.items()}
  for name, w in tensors.items():
    if name == "embeddings.position_embedding.weight":
      out["vision.pos_embed"] = w[None]
      continue
    module, leaf = name.rsplit(".", 1)
    if module in simple:
      out[f"vision.{simple[module]}.{leaf}"] = w
      continue
    _, _, i, rest = module.split(".", 3)
    if rest in layers:
      out[f"vision.blocks.{i}.{layers[rest]}.{leaf}"] = w
    elif rest == "self_attn.q_proj":
      attn = f"encoder.layers.{i}.self_attn."
      out[f"vision.blocks.{i}.attn.qkv.{leaf}"] = np.concatenate(
          [tensors[f"{attn}{p}_proj.{leaf}"] for p in "qkv"]
      )
    elif rest not in ("self_attn.k_proj", "self_attn.v_proj"):
      raise AssertionError(name)
  return out


def _numpy(tensors):
  return {k: v.detach().numpy() for k, v in tensors.items()}


def _rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def test_config_from_deepseek_vision_config():
  """SO400M/14 at 384 px: 27 x 27 patches, MLP width int(1152 * 3.7362)."""
  cfg = siglip.config_from_hf(
      {
          "model_name": "siglip_so400m_patch14_384",
          "image_size": 384,
          "patch_size": 14,
          "width": 1152,
          "layers": 27,
          "heads": 16,
          "mlp_ratio": 3.7362,
          "global_pool": "map",
      }
  )
  assert (cfg.grid, cfg.num_patches, cfg.mlp_dim) == (27, 729, 4304)
  assert siglip.config_from_hf(siglip.hf_vision_config(cfg)) == cfg
  with pytest.raises(ValueError, match="class_token"):
    siglip.config_from_hf({"class_token": True})


def test_patchify_is_the_valid_convolution():
  """patchify + matmul == torch Conv2d(stride=patch) on a non-multiple size."""
  rng = np.random.RandomState(0)
  x = rng.randn(2, 3, 30, 23)
  w = rng.randn(5, 3, 7, 7)
  conv = (
      torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), stride=7)
      .flatten(2)
      .transpose(1, 2)
  )
  ours = np.asarray(siglip.patchify(x, 7)) @ siglip._conv_to_flat(w)[0]
  np.testing.assert_allclose(ours, conv.numpy(), rtol=1e-12, atol=1e-12)


def test_outputs_and_every_gradient_match_transformers_float64():
  """last_hidden_state and d(sum(out * R))/d(param) for every parameter."""
  model = hf_reference(CONFIG)
  rng = np.random.RandomState(1)
  pixels = rng.uniform(-1, 1, (3, 3, CONFIG.image_size, CONFIG.image_size))
  weight = rng.randn(3, CONFIG.num_patches, CONFIG.width)
  x = torch.tensor(pixels, requires_grad=False)
  out = model(pixel_values=x).last_hidden_state
  (out * torch.tensor(weight)).sum().backward()
  ref_out = out.detach().numpy()
  ref_grads = {n: p.grad for n, p in model.named_parameters()}

  names = siglip.siglip_names(CONFIG.patch_size)
  tensors = hf_to_timm(_numpy(dict(model.named_parameters())))
  grads_as_params = hf_to_timm(_numpy(ref_grads))
  with jax.enable_x64(True):
    params = jax.tree.map(jnp.asarray, siglip.params_from_hf(tensors, CONFIG))
    tower = siglip.SiglipVisionTower(CONFIG)

    def loss(p):
      y = tower.apply({"params": p}, jnp.asarray(pixels))
      return jnp.sum(y * weight), y

    (_, ours), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert ours.dtype == jnp.float64
    ref_grad_tree = names.to_flax(grads_as_params, num_experts=0)
    flat_ours = dict(jax.tree_util.tree_leaves_with_path(grads))
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_grad_tree))
  assert _rel(ours, ref_out) <= TOLERANCE
  assert set(flat_ours) == set(flat_ref)
  assert len(flat_ours) == 3 + 12 * CONFIG.layers + 2
  errors = {
      jax.tree_util.keystr(k): _rel(flat_ours[k], flat_ref[k]) for k in flat_ref
  }
  worst = max(errors, key=errors.get)
  print(
      f"siglip output {_rel(ours, ref_out):.1e}; worst gradient {worst} {errors[worst]:.1e}"
  )
  assert errors[worst] <= TOLERANCE, (worst, errors[worst])


def test_name_table_round_trip():
  """Every timm tensor loads, and the export writes the same names and values."""
  model = hf_reference(CONFIG, seed=3)
  tensors = hf_to_timm(_numpy(dict(model.named_parameters())))
  tensors["vision.attn_pool.latent"] = np.zeros((1, 1, CONFIG.width))
  params = siglip.params_from_hf(tensors, CONFIG)
  back = siglip.siglip_names(CONFIG.patch_size).to_hf(params)
  del tensors["vision.attn_pool.latent"]
  assert set(back) == set(tensors)
  for name, w in tensors.items():
    np.testing.assert_allclose(back[name], w, rtol=1e-6, atol=1e-7)
