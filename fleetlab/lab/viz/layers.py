"""What patching did to a model: which attention layer writes which layer of the KV cache.

Input is the ``PatchHandle`` that ``patch_model`` (or ``patch_fleet_model``) returns; its
``layer_ids`` maps each patched attention sub-layer's qualified name to the 0-based id it
uses to index the paged cache. Fleet/Megatron layers also carry a 1-based
``layer_number``; :func:`draw_layer_map` shows both, and where a 1-based id would land.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.patches import FancyArrowPatch, Rectangle

from fleetlab.lab.viz._style import ALERT_COLOR, EDGE_COLOR, new_axes, request_color


@dataclass(slots=True)
class PatchedLayer:
    """One patched attention layer: its module name, cache id, Fleet layer_number (or None),
    sliding window (or None) and the backend class name."""

    name: str
    layer_id: int
    layer_number: int | None
    window: int | None
    backend: str


def _layer_number(model, name: str) -> int | None:
    """``layer_number`` of the nearest enclosing sub-layer of ``name`` that has one."""
    layers = dict(model.named_sublayers())
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        layer = layers.get(".".join(parts[:cut]))
        if layer is not None and hasattr(layer, "layer_number"):
            return int(layer.layer_number)
    return None


def patch_table(handle) -> list[PatchedLayer]:
    """The patched layers of ``handle`` sorted by cache id (see :class:`PatchedLayer`)."""
    rows = [
        PatchedLayer(name, int(layer_id), _layer_number(handle.model, name),
                     handle.sliding_windows.get(layer_id), type(handle.backend).__name__)
        for name, layer_id in handle.layer_ids.items()
    ]
    return sorted(rows, key=lambda r: r.layer_id)


def format_patch_table(handle) -> str:
    """:func:`patch_table` as aligned text, one line per layer."""
    rows = patch_table(handle)
    width = max([len(r.name) for r in rows] + [6])
    lines = [f"{'module':<{width}}  cache id  layer_number  window  backend"]
    for r in rows:
        number = "-" if r.layer_number is None else str(r.layer_number)
        window = "-" if r.window is None else str(r.window)
        lines.append(f"{r.name:<{width}}  {r.layer_id:>8}  {number:>12}  {window:>6}  {r.backend}")
    return "\n".join(lines)


def _short_name(name: str) -> str:
    """``"model.layers.0.self_attn"`` -> ``"layers.0\nself_attn"`` (the layer and the module)."""
    parts = name.split(".")
    index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    head = ".".join(parts[max(0, index - 1): index + 1]) if index is not None else ".".join(parts[:-1])
    return f"{head}\n{parts[-1]}"


def draw_layer_map(handle, *, show_one_based: bool = True, ax=None):
    """Patched attention layers (top) and the KV cache's layers (bottom), joined by arrows.

    Each arrow goes from a patched layer to the cache layer it writes (``layer_id``,
    0-based; gid ``"layer:<layer_id>"``). With ``show_one_based`` and Fleet-style layers, a
    red dashed arrow shows where the 1-based ``layer_number`` would write instead (gid
    ``"one_based:<layer_number>"``): every layer shifted by one, the last one past the end.
    Returns the Figure.
    """
    rows = patch_table(handle)
    n = len(rows)
    fig, ax = new_axes(ax, figsize=(1.5 * (n + 1) + 1.0, 2.8))
    for r in rows:
        x = r.layer_id
        number = f"layer_number {r.layer_number}" if r.layer_number is not None else f"layer_idx {r.layer_id}"
        label = f"{_short_name(r.name)}\n{number}"
        ax.add_patch(Rectangle((x, 1.6), 0.9, 0.8, facecolor=request_color(x), alpha=0.35, edgecolor=EDGE_COLOR))
        ax.text(x + 0.45, 2.0, label, ha="center", va="center", fontsize=6.5)
        ax.add_patch(FancyArrowPatch((x + 0.45, 1.6), (x + 0.45, 0.8), arrowstyle="-|>", mutation_scale=10,
                                     color="black", gid=f"layer:{r.layer_id}"))
        if show_one_based and r.layer_number is not None and r.layer_number != r.layer_id:
            ax.add_patch(FancyArrowPatch((x + 0.6, 1.6), (r.layer_number + 0.3, 0.8), arrowstyle="-|>",
                                         mutation_scale=10, color=ALERT_COLOR, linestyle="--",
                                         gid=f"one_based:{r.layer_number}"))
    one_based = show_one_based and any(r.layer_number is not None for r in rows)
    for slot in range(n + 1 if one_based else n):
        beyond = slot == n
        ax.add_patch(Rectangle((slot, 0.0), 0.9, 0.8, facecolor="white" if beyond else "#e8eef6",
                               edgecolor=ALERT_COLOR if beyond else EDGE_COLOR, linestyle="--" if beyond else "-"))
        ax.text(slot + 0.45, 0.4, "no such\nlayer" if beyond else f"cache\nlayer {slot}", ha="center",
                va="center", fontsize=7, color=ALERT_COLOR if beyond else "black")
    ax.set_xlim(-0.2, n + (1 if one_based else 0))
    ax.set_ylim(-0.1, 2.5)
    ax.axis("off")
    note = "\nblack: the 0-based id patching uses; red dashed: where a 1-based id would write" if one_based else ""
    ax.set_title(f"{handle.family}: {n} attention layers write a paged KV cache of {n} layers{note}", fontsize=9)
    return fig
