"""What every model family provides: a reversible name table and a `Family`.

A family (`switch`, `olmoe`, `deepseek`) owns its config, its backbone, ONE
`NameTable` between Hugging Face tensor names and its Flax parameter paths,
and its size builder. The table serves both directions: `NameTable.to_flax`
(loading, `hf.from_pretrained`) and `NameTable.to_hf` (export,
`export.save_pretrained`). Each `Rule` states its names once, as two
templates with the same fields, and its `Layout` (the transpose, stacking or
split between the two tensors) once, forwards and backwards.

This module is a shared layer: families import it, it imports no family.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Iterable, Mapping

import flax
import flax.linen as nn
import numpy as np

Params = Mapping[str, Any]
ADAPTER_LEAVES = ("lora_a", "lora_b")


def torch_linear(w: np.ndarray) -> np.ndarray:
  """torch Linear [out, in] <-> Flax kernel [in, out] (its own inverse)."""
  return np.ascontiguousarray(np.asarray(w).T)


def _stacked_linear(w: np.ndarray) -> np.ndarray:
  """torch [E, out, in] <-> Flax [E, in, out] (its own inverse)."""
  return np.ascontiguousarray(np.asarray(w).transpose(0, 2, 1))


def _split_halves(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Fused torch [E, 2I, D] (first half's rows first) -> two [E, D, I]."""
  return tuple(_stacked_linear(h) for h in np.split(w, 2, axis=1))


def _join_halves(first: np.ndarray, second: np.ndarray) -> np.ndarray:
  return np.concatenate([_stacked_linear(first), _stacked_linear(second)], 1)


def float32(convert: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
  """`convert` writing float32 (what the export stores)."""
  return lambda *ws: convert(*(np.asarray(w, np.float32) for w in ws))


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one tensor changes between the two sides, stated both ways.

  `load` maps the HF tensor to one Flax value per `Rule.ours` template (its
  dtype kept), `save` maps those values back (as float32). `per_expert`: the HF side holds one tensor
  per expert (field `{e}`), the Flax side one array stacked along a leading
  expert axis; `load` and `save` then apply to each expert's tensor.
  """

  load: Callable[[np.ndarray], tuple[np.ndarray, ...]]
  save: Callable[..., np.ndarray]
  per_expert: bool = False


COPY = Layout(lambda w: (w,), float32(np.ascontiguousarray))
LINEAR = Layout(lambda w: (torch_linear(w),), float32(torch_linear))
EXPERTS = Layout(
    lambda w: (torch_linear(w),), float32(torch_linear), per_expert=True
)
STACKED_LINEAR = Layout(
    lambda w: (_stacked_linear(w),), float32(_stacked_linear)
)
FUSED_HALVES = Layout(_split_halves, float32(_join_halves))

_FIELD = re.compile(r"\{(\w+)(?::([^}]*))?\}")
_DIGITS = ("i", "e")  # block and expert indices; other fields list choices
_INDEX = r"\d+"


@functools.cache
def _compile(template: str, choices: tuple[tuple[str, str], ...]) -> re.Pattern:
  """A template with `{field}` / `{field:a|b}` as a regex of named groups."""
  pattern, end = "", 0
  for m in _FIELD.finditer(template):
    name = m[1]
    alternatives = m[2] or dict(choices).get(name)
    if alternatives is None and name not in _DIGITS:
      raise ValueError(f"{template}: field {{{name}}} lists no choices")
    pattern += re.escape(template[end : m.start()])
    pattern += f"(?P<{name}>{alternatives or _INDEX})"
    end = m.end()
  return re.compile(pattern + re.escape(template[end:]))


def _format(template: str, fields: Mapping[str, str]) -> str:
  return _FIELD.sub(lambda m: str(fields[m[1]]), template)


@dataclasses.dataclass(frozen=True)
class Rule:
  """One HF tensor name <-> one or more Flax paths, with their layout.

  Attributes:
    ours: Flax path template(s), '/'-separated (several for a layout that
      splits one tensor, as `FUSED_HALVES`).
    theirs: the HF name template, '.'-separated, without the table's
      `prefix`. Fields `{i}` and `{e}` match indices; `{name:a|b}` lists a
      field's choices (in either template; the other repeats `{name}`).
    layout: the tensor's change between the two sides.
    load_only: an alternative the loader accepts (e.g. transformers v5's
      fused in-memory experts); the export writes the other rules.
    tied: a load-only second name of the same tensor (Switch's
      `encoder.embed_tokens.weight`), used only when the first is absent.
  """

  ours: str | tuple[str, ...]
  theirs: str
  layout: Layout = LINEAR
  load_only: bool = False
  tied: bool = False

  @property
  def paths(self) -> tuple[str, ...]:
    return (self.ours,) if isinstance(self.ours, str) else tuple(self.ours)

  def _choices(self) -> tuple[tuple[str, str], ...]:
    both = self.paths + (self.theirs,)
    return tuple((m[1], m[2]) for t in both for m in _FIELD.finditer(t) if m[2])

  def match_theirs(self, name: str) -> dict[str, str] | None:
    m = _compile(self.theirs, self._choices()).fullmatch(name)
    return None if m is None else m.groupdict()

  def match_ours(self, path: str) -> dict[str, str] | None:
    if len(self.paths) != 1:  # a split tensor is written from its halves
      return None
    m = _compile(self.paths[0], self._choices()).fullmatch(path)
    return None if m is None else m.groupdict()


def gated_moe_rules(block: str, layer: str) -> tuple[Rule, ...]:
  """The Hugging Face layout of a Llama-style sparse MLP (OLMoE, DeepSeek).

  The router, every expert's gate/up/down projection (one tensor per
  expert, the export layout), and the fused layout of newer checkpoints
  (`gate_up_proj` halves, a stacked `down_proj`), read on load only.
  """
  return (
      Rule(block + "mlp/router/kernel", layer + "mlp.gate.weight"),
      Rule(
          block + "mlp/experts/{p:gate|up|down}/kernel",
          layer + "mlp.experts.{e}.{p}_proj.weight",
          EXPERTS,
      ),
      Rule(
          (block + "mlp/experts/gate/kernel", block + "mlp/experts/up/kernel"),
          layer + "mlp.experts.gate_up_proj",
          FUSED_HALVES,
          load_only=True,
      ),
      Rule(
          block + "mlp/experts/down/kernel",
          layer + "mlp.experts.down_proj",
          STACKED_LINEAR,
          load_only=True,
      ),
  )


@dataclasses.dataclass(frozen=True)
class NameTable:
  """A family's Hugging Face names <-> Flax paths, both directions.

  Attributes:
    family: the family's name in error messages.
    rules: every tensor the backbone has (first match wins).
    prefix: prepended to every HF name on export and optional on load (a
      decoder's `model.`: CausalLM and base-model names both load).
    scope: if set, HF name prefixes the table covers; other tensors are not
      the backbone's and are skipped (Switch's decoder half, its lm_head).
    ignore: HF name suffixes skipped on load (buffers old checkpoints held).
  """

  family: str
  rules: tuple[Rule, ...]
  prefix: str = ""
  scope: tuple[str, ...] = ()
  ignore: tuple[str, ...] = ()

  def to_flax(self, tensors: Mapping[str, np.ndarray], num_experts: int):
    """The Flax parameter tree of a checkpoint's `tensors` (float32).

    Raises:
      ValueError: an unknown tensor, a missing expert, or one parameter
        given twice (e.g. both per-expert and fused expert weights).
    """
    flat: dict[str, np.ndarray] = {}
    tied: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
      name = name.removeprefix(self.prefix)
      if name.endswith(self.ignore) or (
          self.scope and not name.startswith(self.scope)
      ):
        continue
      rule, fields = self._rule_of(name)
      if rule.layout.per_expert:
        path = _format(rule.paths[0], fields)
        experts.setdefault(path, {})[int(fields["e"])] = rule.layout.load(w)[0]
        continue
      target = tied if rule.tied else flat
      for path, value in zip(rule.paths, rule.layout.load(w)):
        path = _format(path, fields)
        if path in target:
          raise ValueError(f"{path}: the checkpoint holds it twice")
        target[path] = value
    for path, per_expert in experts.items():
      if path in flat:
        raise ValueError(
            f"{path}: the checkpoint holds both per-expert and fused weights"
        )
      if sorted(per_expert) != list(range(num_experts)):
        raise ValueError(
            f"{path}: found experts {sorted(per_expert)}, "
            f"expected 0..{num_experts - 1}"
        )
      flat[path] = np.stack([per_expert[e] for e in range(num_experts)])
    flat = {**tied, **flat}  # a tied name only where the first is absent
    return flax.traverse_util.unflatten_dict(flat, sep="/")

  def params_from_hf(
      self, tensors: Mapping[str, np.ndarray], config: Any
  ) -> dict:
    """`to_flax` with `config.num_experts`: a family's `params_from_hf`.

    Tensors outside the backbone (an `lm_head`) must already be filtered
    out (`Family.ignored_prefix`).
    """
    return self.to_flax(tensors, config.num_experts)

  def _rule_of(self, name: str) -> tuple[Rule, dict[str, str]]:
    for rule in self.rules:
      if (fields := rule.match_theirs(name)) is not None:
        return rule, fields
    raise ValueError(
        f"unexpected tensor {name} in the {self.family} checkpoint"
    )

  def to_hf(self, params: Params) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of a backbone's parameters (no adapters)."""
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
    tensors = {}
    for path, value in flat.items():
      if path.rsplit("/", 1)[-1] in ADAPTER_LEAVES:
        raise ValueError(
            f"{path}: adapters are not exported; export the backbone without"
            " them"
        )
      for rule in self.rules:
        if rule.load_only or (fields := rule.match_ours(path)) is None:
          continue
        if rule.layout.per_expert:
          for e, w in enumerate(np.asarray(value)):
            name = _format(rule.theirs, {**fields, "e": e})
            tensors[self.prefix + name] = rule.layout.save(w)
        else:
          name = self.prefix + _format(rule.theirs, fields)
          tensors[name] = rule.layout.save(np.asarray(value))
        break
      else:
        raise ValueError(f"parameter {path} has no Hugging Face name")
    return tensors


def rope_theta(hf: Mapping[str, Any]) -> float:
  """RoPE base from v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(
        f"unsupported RoPE type {rope_type!r} in config.json; only default "
        "RoPE (no scaling) is ported"
    )
  return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


@dataclasses.dataclass(frozen=True)
class Family:
  """How the front door reads (and export writes) one HF `model_type`.

  Attributes:
    backbone: the Flax backbone class, built as `backbone(config)`.
    config_from_hf: `(config.json dict, **options)` -> the family's config.
    params_from_hf: `(tensors, config)` -> the Flax parameter tree.
    ignored_prefix: tensors the backbone does not use (an LM head, a
      decoder).
    prefix: where the backbone's tensors sit ('' = everywhere).
    extra_options: family-only fine-tuning options.
    names: the family's name table (None: `params_from_hf` reads the
      checkpoint, e.g. under `prefix`, and the export writes another entry).
    hf_config: config -> its transformers config, `(config, **extra)`;
      None: this `model_type` is not written by the export.
    heads: heads the export may add as `<head>.weight` (torch layout).
    head_note: why the export refuses the other heads.
    pooling: a classifier's default pooling ('mean' or 'last').
    sequence_classification: the transformers class of the classifier
      with last-token pooling and a bias-free `score`, if there is one.
    hf_backbone_class: the transformers class of the bare backbone (the
      `architectures` of an exported classifier without such a class).
  """

  backbone: type[nn.Module]
  config_from_hf: Callable[..., Any]
  params_from_hf: Callable[[Mapping[str, np.ndarray], Any], dict]
  ignored_prefix: str | tuple[str, ...]
  prefix: str = ""
  extra_options: tuple[str, ...] = ()
  names: NameTable | None = None
  hf_config: Callable[..., Any] | None = None
  heads: tuple[str, ...] = ()
  head_note: str = ""
  pooling: str = "last"
  sequence_classification: str | None = None
  hf_backbone_class: str = ""


def find(families: Iterable[Family], module: nn.Module) -> Family | None:
  """The first family whose backbone `module` is (None: not a backbone)."""
  return next((f for f in families if isinstance(module, f.backbone)), None)


def causal_lm_family(
    stem: str,
    backbone: type[nn.Module],
    config_from_hf: Callable[..., Any],
    names: NameTable,
    hf_config: Callable[..., Any],
    **fields: Any,
) -> Family:
  """The `Family` of a decoder whose transformers classes are `<stem>...`.

  Its checkpoints are `<stem>ForCausalLM` (or `<stem>Model`) saves: the
  backbone skips a causal LM's `lm_head` and an exported classifier's
  `score`, the export may write either head, names the bare backbone
  `<stem>Model` and a classifier `<stem>ForSequenceClassification`, and
  the parameters load through `names`. `fields` override any of these
  (OLMoE has no classifier class) or add others (`extra_options`).
  """
  entry = dict(
      ignored_prefix=("lm_head.", "score."),
      names=names,
      hf_config=hf_config,
      hf_backbone_class=stem + "Model",
      heads=("lm_head", "score"),
      sequence_classification=stem + "ForSequenceClassification",
  )
  return Family(
      backbone, config_from_hf, names.params_from_hf, **{**entry, **fields}
  )
