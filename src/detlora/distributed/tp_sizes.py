"""Which tensor-parallel sizes give one device's bits for a model, from its shapes.

The one rule the engine refuses a size by (``check_tensor_parallel``, before any worker
starts) and the table of real architectures in docs/tensor_parallel.md is computed with
(``invariant_sizes``). A size t keeps the promise when every dimension tensor parallelism
cuts splits over it (``TensorParallelDims``):

* ``heads``: split evenly (attention heads; a Mamba-2 mixer's heads and groups);
* ``kv_heads``: split evenly, or replicated when t is a multiple of their count;
* ``row_k``: the K axis of a row-parallel layer (o_proj: heads x head_dim, down_proj: the
  MLP width, a mixer's out_proj) is summed as ``k_groups(K)`` ordered groups on every size,
  one device included, and t ranks each take G / t of them: t must divide G
  (``detlora.ops.grouped_linear``). The column side of the same width (gate|up) then splits
  evenly too.

The vocabulary never limits t: its shards are padded. Group and shard widths that are not
multiples of any kernel block are fine: a group is one chain from zero on one device and on
a rank alike (docs/tensor_parallel.md says why, kernel by kernel). The rule is the same at
every determinism level: below batch_invariant the ranks all-reduce instead, which needs the
same even splits, and the fingerprint names the size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from detlora.ops.grouped_linear import MAX_K_GROUPS, k_groups

# Every size up to the most K groups a layer sums: each puts its shard boundaries on group
# boundaries. 1, 2, 4, 8.
SUPPORTED_SIZES = tuple(1 << i for i in range(MAX_K_GROUPS.bit_length()))

CutKind = Literal["heads", "kv_heads", "row_k"]


@dataclass(frozen=True)
class Cut:
    """One dimension tensor parallelism cuts: ``what`` names it in errors and tables."""

    what: str
    value: int
    kind: CutKind

    def problem(self, size: int) -> str | None:
        """Why ``size`` ranks cannot share this dimension with one device's bits, or None."""
        if self.kind == "heads":
            if self.value % size:
                return f"{self.what}={self.value} does not split evenly over {size} ranks"
        elif self.kind == "kv_heads":
            if self.value % size and size % self.value:
                return (f"{self.what}={self.value} neither splits evenly over {size} ranks "
                        f"nor replicates evenly onto them")
        else:
            groups = k_groups(self.value)
            if groups % size:
                return (f"{self.what} = {self.value} is summed as k_groups({self.value}) = "
                        f"{groups} ordered group partials, which {size} ranks cannot share")
        return None


@dataclass(frozen=True)
class TensorParallelDims:
    """The cuts of one model (``from_config`` reads them from a Hugging Face config)."""

    cuts: tuple[Cut, ...]

    @classmethod
    def of(cls, *, num_heads: int, num_kv_heads: int, head_dim: int,
           intermediate_sizes: tuple[int, ...] = (), extra: tuple[Cut, ...] = ()
           ) -> TensorParallelDims:
        """Attention of ``num_heads`` query heads of ``head_dim`` and MLPs of the given
        widths, plus ``extra`` cuts (a second head width, a mixer)."""
        cuts = [Cut("num_attention_heads", num_heads, "heads"),
                Cut("num_key_value_heads", num_kv_heads, "kv_heads"),
                Cut("num_attention_heads x head_dim (o_proj's K)", num_heads * head_dim, "row_k")]
        cuts += [Cut("intermediate_size (down_proj's K)", i, "row_k")
                 for i in sorted(set(intermediate_sizes))]
        return cls(tuple(dict.fromkeys([*cuts, *extra])))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TensorParallelDims:
        """The cuts of a Hugging Face ``config.json`` (its ``text_config`` when it has one):
        Llama, Qwen2/2.5/3, Mistral, Phi-3, Gemma 3/4, Nemotron-H."""
        cfg = config.get("text_config") or config
        heads = _int(cfg, "num_attention_heads")
        kv = _int(cfg, "num_key_value_heads", heads)
        head_dim = cfg.get("head_dim") or cfg.get("attention_head_dim")
        head_dim = int(head_dim) if head_dim else _int(cfg, "hidden_size") // heads
        pattern = str(cfg.get("hybrid_override_pattern") or "")  # Nemotron-H: M, -, *
        attention = not pattern or "*" in pattern
        mlp = not pattern or "-" in pattern
        inter = cfg.get("intermediate_size")
        widths = tuple(int(i) for i in (inter if isinstance(inter, list) else [inter])) \
            if mlp and inter else ()
        if mlp and cfg.get("use_double_wide_mlp"):  # Gemma 4: 2x on KV-shared layers
            widths += tuple(2 * i for i in widths)
        extra: list[Cut] = []
        if attention and cfg.get("global_head_dim"):  # Gemma 4's full-attention layers
            extra.append(Cut("num_attention_heads x global_head_dim (o_proj's K)",
                             heads * int(cfg["global_head_dim"]), "row_k"))
        if attention and cfg.get("num_global_key_value_heads"):
            extra.append(Cut("num_global_key_value_heads",
                             int(cfg["num_global_key_value_heads"]), "kv_heads"))
        if "M" in pattern:  # Mamba-2 mixers: heads and groups split, out_proj row-parallel
            mh = _int(cfg, "mamba_num_heads")
            extra += [Cut("mamba_num_heads", mh, "heads"),
                      Cut("n_groups", _int(cfg, "n_groups"), "heads"),
                      Cut("mamba_num_heads x mamba_head_dim (out_proj's K)",
                          mh * _int(cfg, "mamba_head_dim"), "row_k")]
        if attention:
            return cls.of(num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                          intermediate_sizes=widths, extra=tuple(extra))
        return cls(tuple(extra) + tuple(
            Cut("intermediate_size (down_proj's K)", i, "row_k") for i in sorted(set(widths))))

    def problems(self, size: int) -> list[str]:
        """Every reason ``size`` ranks would not give one device's bits (empty: they do)."""
        if size not in SUPPORTED_SIZES:
            return [f"tensor_parallel_size must be one of {list(SUPPORTED_SIZES)}"]
        return [p for cut in self.cuts if (p := cut.problem(size)) is not None]


def invariant_sizes(dims: TensorParallelDims) -> tuple[int, ...]:
    """The supported sizes whose bits equal one device's for these dims."""
    return tuple(t for t in SUPPORTED_SIZES if not dims.problems(t))


def check_tensor_parallel(dims: TensorParallelDims, size: int) -> None:
    """Refuse ``size`` when it cannot give one device's bits, naming the dimensions and the
    sizes that can."""
    problems = dims.problems(size)
    if problems:
        keep = ", ".join(map(str, invariant_sizes(dims)))
        raise ValueError(f"tensor_parallel_size={size} cannot run this model with one "
                         f"device's bits: {'; '.join(problems)}. Sizes that keep them: {keep}")


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


__all__ = ["SUPPORTED_SIZES", "Cut", "TensorParallelDims", "check_tensor_parallel",
           "invariant_sizes"]
