"""Drawings of the paged KV cache: the block pool as a grid, block tables, and waste.

- :func:`draw_block_pool`: every physical block as a square, coloured by the request that
  owns it; shared blocks are hatched and show their reference count; free blocks that
  still hold a cached prefix are grey and numbered in the order they will be evicted.
- :func:`draw_block_tables`: each request's block table (logical block -> physical id),
  with how full each block is.
- :func:`draw_block_mapping`: the indirection itself: each request's logical blocks with an
  arrow into the physical pool (two arrows into one block: a shared prefix).
- :func:`pool_frame`: the pool and every running request's block table, captured from a
  live ``fleetlab.LLM`` after a step (for drawing the pool step by step).
- :func:`memory_waste` / :func:`draw_memory_waste`: KV slots reserved versus used when
  memory is paged, padded to the longest request, or reserved for ``max_model_len``.

Every rectangle carries a ``gid`` (``"block:<id>"``, ``"table:<req>:<j>"``, ``"logical:<req>:<j>"``,
``"physical:<id>"``, ``"map:<req>:<j>"``, ``"waste:<strategy>:<used|wasted>"``) so that tests and
curious readers can find it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from fleetlab.inspect.pool import pool_snapshot
from fleetlab.kv.block_pool import BlockPool
from fleetlab.lab.viz._style import (
    CACHED_FREE_COLOR,
    EDGE_COLOR,
    FREE_COLOR,
    REVIVED_COLOR,
    UNKNOWN_OWNER_COLOR,
    new_axes,
    request_color,
)


def _block_infos(pool_or_snapshot):
    """A pool's :func:`~fleetlab.inspect.pool.pool_snapshot`, or the given list of ``BlockInfo`` as is."""
    return pool_snapshot(pool_or_snapshot) if isinstance(pool_or_snapshot, BlockPool) else list(pool_or_snapshot)


def block_owners(block_tables: Mapping[object, Sequence[int]]) -> dict[int, list]:
    """Invert block tables: ``{block_id: [request ids holding it, in table order]}``."""
    owners: dict[int, list] = {}
    for req_id, blocks in block_tables.items():
        for block in blocks:
            owners.setdefault(int(block), []).append(req_id)
    return owners


def eviction_ranks(infos) -> dict[int, int]:
    """``{block id: n}`` for every free block that still holds a cached prefix: it is the n-th
    of them the pool will overwrite (1 = first). The free queue hands out blocks from its head,
    empty or cached alike, so the empty blocks ahead of a cached one go first."""
    cached = sorted((i for i in infos if i.ref_count == 0 and i.is_cached), key=lambda i: i.lru_position)
    return {info.block_id: n for n, info in enumerate(cached, start=1)}


def block_face(info, owners: Sequence, eviction_rank: int | None = None) -> tuple[str, str | None, str]:
    """``(face colour, hatch, label)`` of one block of the grid (see :func:`draw_block_pool`)."""
    if info.ref_count > 0:
        color = request_color(owners[0]) if owners else UNKNOWN_OWNER_COLOR
        shared = info.ref_count > 1
        return color, ("xx" if shared else None), (f"x{info.ref_count}" if shared else "")
    if info.is_cached:
        return CACHED_FREE_COLOR, "..", str(eviction_rank) if eviction_rank is not None else ""
    return FREE_COLOR, None, ""


def draw_block_pool(pool, block_tables: Mapping[object, Sequence[int]] | None = None, *, ncols: int = 8,
                    ax=None, title: str | None = None, revived: Iterable[int] = (), legend: bool = True,
                    fill: Mapping[int, float] | None = None):
    """Draw a block pool as a grid of squares, one per physical block, in block-id order.

    Args:
      pool: a :class:`fleetlab.BlockPool`, a list of its ``BlockInfo`` (``pool_snapshot(pool)``), or
        a :class:`PoolFrame` (then ``block_tables`` defaults to the frame's).
      block_tables: ``{request id: block ids}`` of the live requests, to colour each block by
        its owner (first owner when shared). Without it, blocks in use are dark grey.
      ncols: squares per grid row.
      ax: draw into these axes; default a new figure.
      revived: block ids to outline in green: blocks a request just took from the prefix
        cache instead of computing them (gid ``"revived:<id>"``).
      legend: draw the legend (:func:`pool_legend`) right of the grid.
      fill: ``{block id: share of its slots holding a token}``: the empty part of each of
        these blocks is drawn white and hatched (gid ``"empty:<id>"``), so a request's
        half-full last block shows what paging wastes.
    Colours: a request's colour for its blocks (hatched ``xx`` and labelled ``xN`` when N
    requests share it); grey dotted for a free block that still holds a cached prefix
    (labelled n: the n-th such block to be evicted, :func:`eviction_ranks`); white for a free
    block. Each square shows its block id in the corner.
    Returns the ``matplotlib.figure.Figure``.
    """
    if isinstance(pool, PoolFrame):
        block_tables = pool.block_tables if block_tables is None else block_tables
        pool = pool.blocks
    infos = _block_infos(pool)
    owners = block_owners(block_tables or {})
    revived = {int(b) for b in revived}
    ranks = eviction_ranks(infos)
    nrows = max(1, -(-len(infos) // ncols))
    fig, ax = new_axes(ax, figsize=(0.6 * ncols + 1.8, 0.6 * nrows + 0.8))
    for info in infos:
        row, col = divmod(info.block_id, ncols)
        color, hatch, label = block_face(info, owners.get(info.block_id, []), ranks.get(info.block_id))
        ax.add_patch(Rectangle((col, -row), 0.92, 0.92, facecolor=color, edgecolor=EDGE_COLOR, hatch=hatch,
                               linewidth=1.0, gid=f"block:{info.block_id}"))
        share = (fill or {}).get(info.block_id)
        if share is not None and share < 1:
            ax.add_patch(Rectangle((col + 0.92 * share, -row), 0.92 * (1 - share), 0.92, facecolor="white",
                                   edgecolor=EDGE_COLOR, hatch="///", linewidth=0.6, gid=f"empty:{info.block_id}"))
        if info.block_id in revived:
            ax.add_patch(Rectangle((col - 0.04, -row - 0.04), 1.0, 1.0, facecolor="none", edgecolor=REVIVED_COLOR,
                                   linewidth=2.5, gid=f"revived:{info.block_id}"))
        ax.text(col + 0.08, -row + 0.78, str(info.block_id), fontsize=7, color="#222222")
        if label:
            # an opaque disc, so the digit reads on its own and not through the hatch's dots
            ax.text(col + 0.46, -row + 0.36, label, fontsize=7.5, ha="center", va="center", color="#111111",
                    gid=f"label:{info.block_id}",
                    bbox={"boxstyle": "circle,pad=0.25", "facecolor": "white", "edgecolor": "#888888",
                          "linewidth": 0.5})
    ax.set_xlim(-0.1, ncols)
    ax.set_ylim(-nrows + 0.9, 1.0)
    ax.set_aspect("equal")
    ax.axis("off")
    if legend:
        handles = pool_legend(block_tables or {}, shared=any(i.ref_count > 1 for i in infos), revived=bool(revived),
                              cached=any(i.ref_count == 0 and i.is_cached for i in infos))
        if fill and any(v < 1 for v in fill.values()):
            handles.append(Patch(facecolor="white", hatch="///", edgecolor=EDGE_COLOR, label="slots holding no token"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or f"block pool: {sum(i.ref_count > 0 for i in infos)}/{len(infos)} blocks in use",
                 fontsize=9)
    return fig


def pool_legend(requests: Iterable = (), *, shared: bool = True, revived: bool = True, cached: bool = True) -> list:
    """Legend handles of :func:`draw_block_pool`: the requests, then the block states (shared,
    revived and free-but-cached only when asked for)."""
    handles = [Patch(facecolor=request_color(r), edgecolor=EDGE_COLOR, label=f"req {r}") for r in requests]
    if shared:
        handles.append(Patch(facecolor="white", hatch="xx", edgecolor=EDGE_COLOR, label="shared (xN: N owners)"))
    if revived:
        handles.append(Patch(facecolor="white", edgecolor=REVIVED_COLOR, linewidth=2.5,
                             label="just taken from\nthe prefix cache"))
    if cached:
        handles.append(Patch(facecolor=CACHED_FREE_COLOR, hatch="..", edgecolor=EDGE_COLOR,
                             label="free, still cached\n(n: n-th to be evicted)"))
    handles.append(Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free"))
    return handles


def draw_block_tables(block_tables: Mapping[object, Sequence[int]], num_tokens: Mapping[object, int] | None = None,
                      block_size: int | None = None, *, ax=None, title: str | None = None):
    """Draw each request's block table as a row of cells: logical block j -> physical id.

    Args:
      block_tables: ``{request id: physical block ids in logical order}``.
      num_tokens: ``{request id: tokens stored}``; with ``block_size`` each cell is shaded
        up to how full it is, so the half-empty last block (paging's only waste) shows.
      block_size: tokens per block (needed with ``num_tokens``).
    Returns the Figure. Cells have gid ``"table:<request id>:<logical index>"`` and their
    shaded part ``"fill:<request id>:<logical index>"`` (width 0.92 = a full block).
    """
    if num_tokens is not None and not block_size:
        raise ValueError("draw_block_tables: num_tokens needs block_size")
    req_ids = list(block_tables)
    width = max([len(b) for b in block_tables.values()] + [1])
    fig, ax = new_axes(ax, figsize=(0.6 * width + 1.6, 0.45 * len(req_ids) + 0.9))
    for y, req_id in enumerate(req_ids):
        for j, block in enumerate(block_tables[req_id]):
            fill = 1.0
            if num_tokens is not None:
                fill = min(1.0, max(0.0, (num_tokens[req_id] - j * block_size) / block_size))
            ax.add_patch(Rectangle((j, -y), 0.92, 0.8, facecolor="white", edgecolor=EDGE_COLOR,
                                   gid=f"table:{req_id}:{j}"))
            ax.add_patch(Rectangle((j, -y), 0.92 * fill, 0.8, facecolor=request_color(req_id), alpha=0.85,
                                   gid=f"fill:{req_id}:{j}"))
            ax.text(j + 0.46, -y + 0.4, str(block), ha="center", va="center", fontsize=8)
    ax.set_yticks([-y + 0.4 for y in range(len(req_ids))], [f"req {r}" for r in req_ids], fontsize=8)
    ax.set_xticks([j + 0.46 for j in range(width)], [str(j) for j in range(width)], fontsize=7)
    ax.set_xlabel("logical block (position // block_size); cell text = physical block id", fontsize=8)
    ax.set_xlim(-0.1, width)
    ax.set_ylim(-len(req_ids) + 0.9, 0.9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or "block tables", fontsize=9)
    return fig


def _owner_face(block_id: int, owners: Mapping[int, list], info=None) -> tuple[str, str | None]:
    """Face colour and hatch of a physical block in :func:`draw_block_mapping`."""
    holders = owners.get(block_id, [])
    if holders:
        shared = len(holders) > 1 or (info is not None and info.ref_count > 1)
        return request_color(holders[0]), ("xx" if shared else None)
    if info is not None and info.ref_count > 0:
        return UNKNOWN_OWNER_COLOR, None
    if info is not None and info.is_cached:
        return CACHED_FREE_COLOR, ".."
    return FREE_COLOR, None


def draw_block_mapping(block_tables: Mapping[object, Sequence[int]], pool,
                       num_tokens: Mapping[object, int] | None = None, block_size: int | None = None, *,
                       ax=None, title: str | None = None):
    """The indirection of paging: each request's logical blocks (left) with an arrow into the
    physical block that holds them (right).

    Args:
      block_tables: ``{request id: physical block ids in logical order}``.
      pool: a :class:`fleetlab.BlockPool` (its blocks' state colours the free ones: grey dotted
        still cached, white free) or the number of physical blocks.
      num_tokens: ``{request id: tokens stored}``; with ``block_size`` each logical block is
        labelled with the positions it holds and shaded up to how full it is.
      block_size: tokens per block; each physical block is then labelled with its slots
        (``block_id * block_size`` onwards).
    A physical block two requests point at (a shared prefix) is hatched and receives two
    arrows. Logical blocks have gid ``"logical:<req>:<j>"``, physical blocks ``"physical:<id>"``,
    arrows ``"map:<req>:<j>"`` (from logical block j of req). Returns the Figure.
    """
    if num_tokens is not None and not block_size:
        raise ValueError("draw_block_mapping: num_tokens needs block_size")
    infos = _block_infos(pool) if not isinstance(pool, int) else None
    num_blocks = len(infos) if infos is not None else int(pool)
    for req_id, blocks in block_tables.items():
        bad = [b for b in blocks if not 0 <= int(b) < num_blocks]
        if bad:
            raise ValueError(f"draw_block_mapping: req {req_id} holds blocks {bad} outside the pool [0, {num_blocks})")
    owners = block_owners(block_tables)
    gap = 0.6
    logical_height = sum(len(b) for b in block_tables.values()) + gap * max(len(block_tables) - 1, 0)
    height = max(logical_height, num_blocks)
    fig, ax = new_axes(ax, figsize=(7.2, 0.32 * height + 1.2))
    x_log, w_log, x_phys, w_phys = 0.0, 2.2, 5.0, 2.6
    # logical blocks, one group per request, centred against the pool
    y = (height - logical_height) / 2
    centres = {}
    for req_id, blocks in block_tables.items():
        ax.text(x_log - 0.15, -(y + len(blocks) / 2), f"req {req_id}", ha="right", va="center", fontsize=9,
                color=request_color(req_id), fontweight="bold")
        for j, _ in enumerate(blocks):
            top = -(y + j)
            fill, text = 1.0, f"logical block {j}"
            if num_tokens is not None:
                first, n = j * block_size, num_tokens[req_id]
                fill = min(1.0, max(0.0, (n - first) / block_size))
                last = min(n, first + block_size) - 1
                text = f"block {j}: pos {first}-{last}" if last > first else f"block {j}: pos {first}"
            ax.add_patch(Rectangle((x_log, top - 0.9), w_log, 0.9, facecolor="white", edgecolor=EDGE_COLOR,
                                   gid=f"logical:{req_id}:{j}"))
            ax.add_patch(Rectangle((x_log, top - 0.9), w_log * fill, 0.9, facecolor=request_color(req_id),
                                   alpha=0.45, edgecolor="none"))
            ax.text(x_log + w_log / 2, top - 0.45, text, ha="center", va="center", fontsize=7.5)
            centres[(req_id, j)] = top - 0.45
        y += len(blocks) + gap
    # physical pool, block 0 on top
    y0 = (height - num_blocks) / 2
    for b in range(num_blocks):
        top = -(y0 + b)
        color, hatch = _owner_face(b, owners, infos[b] if infos is not None else None)
        ax.add_patch(Rectangle((x_phys, top - 0.9), w_phys, 0.9, facecolor=color, edgecolor=EDGE_COLOR, hatch=hatch,
                               alpha=0.85, gid=f"physical:{b}"))
        text = f"block {b}" + (f"  slots {b * block_size}-{(b + 1) * block_size - 1}" if block_size else "")
        ax.text(x_phys + w_phys / 2, top - 0.45, text, ha="center", va="center", fontsize=7.5,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.75})
    for req_id, blocks in block_tables.items():
        for j, b in enumerate(blocks):
            arrow = FancyArrowPatch((x_log + w_log + 0.05, centres[(req_id, j)]), (x_phys - 0.05, -(y0 + b) - 0.45),
                                    arrowstyle="-|>", mutation_scale=11, color=request_color(req_id), linewidth=1.3,
                                    gid=f"map:{req_id}:{j}")
            ax.add_patch(arrow)
    ax.text(x_log + w_log / 2, 0.35, "each request's logical blocks", ha="center", fontsize=8.5)
    ax.text(x_phys + w_phys / 2, 0.35, f"physical KV cache: {num_blocks} blocks", ha="center", fontsize=8.5)
    ax.set_xlim(x_log - 1.3, x_phys + w_phys + 0.1)
    ax.set_ylim(-height - 0.2, 0.9)
    ax.axis("off")
    ax.set_title(title or "block tables: logical block -> physical block", fontsize=9)
    return fig


@dataclass(slots=True)
class PoolFrame:
    """The block pool as it stood after one engine step: every block's state
    (``BlockInfo`` list), the block table of every running request, and the block size."""

    step: int
    blocks: list
    block_tables: dict = field(default_factory=dict)
    block_size: int | None = None


def pool_frame(llm, step: int | None = None) -> PoolFrame:
    """Capture ``llm``'s block pool and its running requests' block tables, right after a step.

    ``step`` defaults to the step just run (the last trace's, or the scheduler's count - 1).
    Call it after every ``llm.step()`` to draw the pool step by step
    (:func:`fleetlab.lab.viz.draw_engine_step` with ``pool_frames=``).
    """
    if step is None:
        step = llm.traces[-1].step if getattr(llm, "traces", None) else llm.stats()["num_steps"] - 1
    tables = {str(rid): [int(b) for b in blocks] for rid, blocks in llm.block_tables().items()}
    return PoolFrame(int(step), pool_snapshot(llm.pool), tables, llm.pool.block_size)


@dataclass(slots=True)
class MemoryWaste:
    """KV token slots three ways of laying out the same requests would take.

    tokens: slots the requests' tokens actually fill (the same for every layout).
    paged: slots held by whole blocks (each request rounds up to ``block_size``).
    padded: slots when every request is padded to the longest one (a static batch).
    reserved: slots when every request reserves ``max_model_len`` up front.
    """

    tokens: int
    paged: int
    padded: int
    reserved: int

    def wasted_fraction(self, layout: str) -> float:
        """Share of a layout's slots that hold no token (``layout``: paged, padded, reserved)."""
        total = getattr(self, layout)
        return (total - self.tokens) / total if total else 0.0


def memory_waste(lengths: Sequence[int], block_size: int, max_model_len: int | None = None) -> MemoryWaste:
    """Slots used by requests of ``lengths`` tokens under paging, padding and reservation.

    ``max_model_len`` defaults to the longest length (then reservation equals padding).
    """
    lengths = [int(n) for n in lengths]
    if block_size < 1 or any(n < 0 for n in lengths):
        raise ValueError(f"memory_waste: need block_size >= 1 and lengths >= 0; got {block_size}, {lengths}")
    longest = max(lengths, default=0)
    max_model_len = longest if max_model_len is None else int(max_model_len)
    if max_model_len < longest:
        raise ValueError(f"memory_waste: max_model_len={max_model_len} is shorter than a request ({longest})")
    paged = sum(-(-n // block_size) * block_size for n in lengths)
    return MemoryWaste(tokens=sum(lengths), paged=paged, padded=longest * len(lengths),
                       reserved=max_model_len * len(lengths))


def draw_memory_waste(lengths: Sequence[int], block_size: int, max_model_len: int | None = None, *, ax=None):
    """Stacked bars of used and wasted KV slots for paging, padding and reservation.

    Args: as :func:`memory_waste`. Each bar is split into slots holding tokens (solid) and
    empty slots (light, labelled with the wasted percentage). Returns the Figure; bars
    have gid ``"waste:<paged|padded|reserved>:<used|wasted>"``.
    """
    waste = memory_waste(lengths, block_size, max_model_len)
    layouts = {"paged": f"paged\n(block {block_size})", "padded": "padded to\nlongest",
               "reserved": "reserve\nmax_model_len"}
    fig, ax = new_axes(ax, figsize=(4.6, 3.0))
    for x, layout in enumerate(layouts):
        total = getattr(waste, layout)
        used = ax.bar(x, waste.tokens, color="#4e79a7", width=0.6)[0]
        wasted = ax.bar(x, total - waste.tokens, bottom=waste.tokens, color="#f4c7c3", width=0.6)[0]
        used.set_gid(f"waste:{layout}:used")
        wasted.set_gid(f"waste:{layout}:wasted")
        ax.text(x, total, f"{100 * waste.wasted_fraction(layout):.0f}% empty", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(layouts)), list(layouts.values()), fontsize=8)
    ax.set_ylabel("KV slots (tokens)")
    ax.set_ylim(0, max(waste.reserved, waste.paged, waste.padded, 1) * 1.4)  # room above for labels and legend
    ax.legend(handles=[Patch(color="#4e79a7", label="holds a token"), Patch(color="#f4c7c3", label="empty")],
              fontsize=7, loc="upper left", frameon=False, ncols=2)
    ax.set_title(f"{len(lengths)} requests, {waste.tokens} tokens", fontsize=9)
    return fig
