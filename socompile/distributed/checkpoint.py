"""Sharded checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own shards.

    sd.save("ckpt", model, opt, step=step)       # every rank calls it; a directory, replaced atomically
    extra = sd.load("ckpt", model, opt)          # -> {"step": step}; any world size, sharded or not
    full = sd.full_optimizer_state_dict(opt)     # torch.optim.AdamW's layout, gathered on rank 0 (None elsewhere)

What is in the directory (DCP keys):

    model.<name>                      the model's state_dict (the same on every rank: DCP writes it once)
    optim.state.<k>.step              parameter k's step count (k: its index in the optimizer, as in torch's layout)
    optim.state.<k>.exp_avg[_sq]      its moments, flattened to 1-D (numel elements); each rank writes the
                                      contiguous piece its buckets' windows hold, so the pieces tile the tensor
    optim.state.<k>.master            separate host master (host_master="separate") and a parameter that is not
                                      fp32: the fp32 master its (bf16) weights round, whole, like the model (the
                                      same on every rank after the all-gather: DCP writes it once); device-side
                                      ZeRO (runtime/sharded_bucket.py: each rank holds 1/W of the master) writes
                                      it flat, as pieces, like the moments. A load takes either form
    optim.param_groups, extra, meta   small pickled values (read back with weights_only=True)
    checksums.<rank>                  crc32s (``integrity.py``) of what that rank wrote: each moment piece as
                                      ``<key>@<offset>``, and (rank 0) the whole tensors: model, steps, masters

Verified (format version 2 and later): after the load every rank recomputes the crc32 of the whole tensors and of each
saved piece that lies inside what it loaded (all of them when the world size and bucket layout are the saving
run's, or in one process; pieces that straddle two loading ranks' windows are not verified), and checks the
values (moments finite, second moments >= 0). A problem on any rank raises on every rank (no rank is left
waiting in a collective), naming the directory, the entry and the rank. DCP loads in place, so a refused load
leaves the model and optimizer partly overwritten: load another checkpoint or build them again. Version-1
directories (no checksums) load with a warning.

Separate host master: the model's tensors are views of the device ``weights`` (a weight-flow bucket's are
refilled from the master for the save and the load, ``AdamW.materialized_weights``); after a load the master is
taken from the loaded weights (exact for fp32 parameters), then from ``optim.state.<k>.master`` where the
checkpoint has it (a checkpoint without it gives a bf16 parameter the master of its bf16 value), and uploaded.

Moments are keyed by parameter, not by bucket: the bucket layout depends on the world size, the bucket size and
on what was compiled, a parameter's flat elements do not. Loading asks DCP for the pieces the loading rank's
windows need, wherever they were written: saved with DP=2, loaded with DP=3, or into one process (sharded or
not, or with no process group at all).

Each piece is a ``_FlatPiece``: DCP's planners accept objects that describe their own chunks
(``__create_write_items__`` / ``__create_chunk_list__``), which is how DTensor plugs in; our pieces are
arbitrary contiguous ranges, which no DTensor placement expresses. The planners here only add the lookup of
such a piece (``lookup_object`` / ``lookup_tensor``, DCP's documented extension points) and read small values
with ``weights_only=True``.

NOTE: atomic save. DCP writes a directory, and a directory cannot be renamed over a non-empty one. Every rank
writes into ``.<name>.tmp`` next to the target; after a barrier rank 0 renames the old checkpoint to
``.<name>.prev``, the new one to ``<name>``, removes ``.prev`` and fsyncs the folder. A process killed at any
point leaves the previous checkpoint complete: as ``<name>``, or (killed between the two renames) as
``.<name>.prev``, which ``load`` falls back to and the next save cleans up.
"""
from __future__ import annotations

import contextlib
import io
import os
import pathlib
import shutil
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .. import integrity
from ..checkpoint import _fsync_dir, _module, log
from ..optim.bucket_layout import alias_state
from ..runtime.int8_moments import round_seed

FORMAT = "socompile-dcp-checkpoint"
VERSION = 3   # 3: a device-sharded bucket's fp32 master as flat pieces; 2: "checksums.<rank>" entries; 1: none


class _FlatPiece:
    """Elements [offset, offset + local.numel()) of a flattened tensor of ``numel`` elements, held by this rank."""

    def __init__(self, local: torch.Tensor, offset: int, numel: int):
        self.local, self.offset, self.numel = local.reshape(-1), offset, numel

    def size(self) -> torch.Size:   # DCP compares it with the saved size on load
        return torch.Size([self.numel])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self.local.numel() == 0:
            return []
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([self.offset])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.size()))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.local.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.local if isinstance(obj, _FlatPiece) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's set-up first walks the state dict to materialise meta tensors, and that walk
        # replaces objects it does not know (our pieces) with None. Nothing here is on the meta device: flatten only.
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.local if isinstance(obj, _FlatPiece) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:   # small values: no arbitrary unpickling
        from torch.distributed.checkpoint._nested_dict import set_element
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=True))


def _pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(value: bytes) -> Any:
    return torch.load(io.BytesIO(value), weights_only=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group) -> int:
    return dist.get_rank(group) if _distributed() else 0


def _barrier(group) -> None:
    if _distributed():
        dist.barrier(group=group)


# ---------------------------------------------------------------------------------------------- optimizer
def _check_optimizer(optimizer) -> None:
    from ..optim.adamw import AdamW
    if not isinstance(optimizer, AdamW):
        raise TypeError(f"socompile.distributed checkpoints hold a socompile.AdamW's state; got "
                        f"{type(optimizer).__name__}. Use torch.distributed.checkpoint.state_dict for torch optimizers.")


def _optimizer_entries(optimizer, fresh_steps: bool):
    """(index, parameter, bucket, slot, state dict entries) for every parameter: steps as scalar tensors (new
    ones when ``fresh_steps``, for loading), moments as the pieces this rank's buckets hold."""
    optimizer.wait_pending()
    index_of = {id(p): k for k, p in enumerate(optimizer.all_params())}
    for bucket in optimizer.buckets:
        for i, p in enumerate(bucket.params):
            held = bucket.held(i)
            a, b = held if held is not None else (0, 0)
            step = torch.tensor(0.0 if fresh_steps else float(bucket.steps[i]), dtype=torch.float32)
            entry = {"step": step}
            for key, part in zip(("exp_avg", "exp_avg_sq"), _moment_pieces(bucket, i, fresh_steps)):
                entry[key] = _FlatPiece(part, a, p.numel())
            if bucket.mirror and p.dtype != torch.float32:   # the fp32 master the low-precision weights round
                if bucket.device_shard is not None:   # device-side ZeRO: this rank's piece, as the moments
                    entry["master"] = _FlatPiece(torch.empty(b - a, dtype=torch.float32) if fresh_steps
                                                 else _master_piece(bucket, i), a, p.numel())
                else:
                    entry["master"] = (torch.empty(p.shape, dtype=torch.float32) if fresh_steps
                                       else bucket.view(bucket.master, i))
            yield index_of[id(p)], p, bucket, i, entry


def _moment_pieces(bucket, i: int, for_loading: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameter i's held moments as the checkpoint keeps them, fp32 or bf16 as the bucket holds them: views of
    the buffers (DCP loads into them in place), or for int8 blocks fp32 values, decoded for saving or new
    tensors for loading (``_encode_loaded`` packs them)."""
    held = bucket.held(i)
    if held is None:
        return bucket.exp_avg[:0], bucket.exp_avg_sq[:0]
    if bucket.moment_format != "int8":
        return bucket.state_part(bucket.exp_avg, i), bucket.state_part(bucket.exp_avg_sq, i)
    if for_loading:
        return torch.zeros(held[1] - held[0]), torch.zeros(held[1] - held[0])
    return bucket.moment_values(i)


def _encode_loaded(bucket, i: int, entry: dict, steps: int) -> None:
    """Pack the fp32 moments loaded for an int8 bucket's parameter i, rounded as a load in one process rounds
    them (the seed optim/state_dict.py draws for a load)."""
    if bucket.moment_format == "int8" and bucket.held(i) is not None:
        bucket.set_held_moments(i, entry["exp_avg"].local, entry["exp_avg_sq"].local,
                                seed=round_seed(bucket.index, steps, bucket.offsets[i]))


def _master_piece(bucket, i: int) -> torch.Tensor:
    """The part of parameter i's fp32 master that a device-sharded bucket holds (its ``held(i)`` elements: the
    master's window is the moments'), flat."""
    a, b = bucket.held(i) or (0, 0)
    start = bucket.offsets[i] + a
    return bucket.master[bucket.host(start, start + b - a)]


def _master_as_saved(entry: dict, saved_size: torch.Size) -> None:
    """Make a load entry's master take the form the checkpoint has it in: whole in the parameter's shape (a
    run without device-side ZeRO wrote it) or flat pieces (a device-sharded run wrote them). DCP reads chunks in
    the saved tensor's coordinates, so a flat piece cannot be read from a whole N-d tensor, nor the reverse:
    the other form is loaded whole into a temporary (one parameter at a time) and copied (``_store_master``)."""
    master = entry["master"]
    wanted = master.size() if isinstance(master, _FlatPiece) else master.shape
    if saved_size != wanted:
        entry["master"] = torch.empty(saved_size, dtype=torch.float32)


def _store_master(bucket, i: int, value) -> None:
    """A loaded fp32 master (a piece of it, or the whole parameter in either form) into the bucket's master."""
    if bucket.device_shard is None:
        bucket.view(bucket.master, i).copy_(value.reshape(bucket.params[i].shape))
    elif isinstance(value, _FlatPiece):
        _master_piece(bucket, i).copy_(value.local)
    else:
        bucket.load_segment_window(i, value)   # whole: this rank's window of it


def _groups(optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


# ---------------------------------------------------------------------------------------------- save/load
def save(path: str | os.PathLike, model=None, optimizer=None, *, group=None,
         _before_rename: Callable[[], None] | None = None, **extra: Any) -> pathlib.Path:
    """Write a DCP checkpoint directory at ``path``; every rank of ``group`` (default: the whole job) calls it,
    after ``opt.step()``. Works without torch.distributed too (one process writes everything).
    ``_before_rename``: a test hook run on rank 0 after every rank has written, before the rename."""
    path = pathlib.Path(path)
    tmp, prev = path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.prev"
    state: dict[str, Any] = {"meta": _pack({"format": FORMAT, "version": VERSION,
                                            "world": dist.get_world_size(group) if _distributed() else 1}),
                             "extra": _pack(extra)}
    if optimizer is not None:
        _check_optimizer(optimizer)
    with _weights_held(model, optimizer, pull=False):
        if model is not None:
            state["model"] = _module(model).state_dict()
        if optimizer is not None:
            state["optim"] = {"state": {str(k): entry for k, *_, entry in _optimizer_entries(optimizer, False)},
                              "param_groups": _pack(_groups(optimizer))}
        rank = _rank(group)
        state[f"checksums.{rank}"] = _pack(_checksums(state, whole=rank == 0))
        _write(state, path, tmp, prev, group)
    _barrier(group)   # every rank's files are written (DCP fsyncs them) before rank 0 publishes the directory
    if _rank(group) == 0:
        if _before_rename is not None:
            _before_rename()
        _fsync_dir(tmp)
        if path.exists():
            path.rename(prev)
        tmp.rename(path)
        _fsync_dir(path.parent)
        shutil.rmtree(prev, ignore_errors=True)
    _barrier(group)
    return path


def _weights_held(model, optimizer, pull: bool):
    """Separate host master: every parameter holds its weights (weight-flow buckets refilled from the master)
    while the block runs; with ``pull`` the master is taken from the weights at exit (the model was loaded)."""
    if model is None or optimizer is None:
        return contextlib.nullcontext()
    return optimizer.materialized_weights(pull=pull)


def _write(state: dict, path: pathlib.Path, tmp: pathlib.Path, prev: pathlib.Path, group) -> None:
    if _rank(group) == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if prev.exists() and not path.exists():   # a save was killed between its renames: keep that one
            prev.rename(path)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(prev, ignore_errors=True)
        tmp.mkdir()
    _barrier(group)
    with warnings.catch_warnings():   # DCP warns that one process without torch.distributed saves alone: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp, planner=_SavePlanner(), process_group=group, no_dist=not _distributed())


def load(path: str | os.PathLike, model=None, optimizer=None, *, group=None, strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` (with any world size) into ``model`` and a socompile.AdamW,
    sharded or not; return the ``extra`` values. Every rank of ``group`` calls it (or one process, without
    torch.distributed)."""
    path = pathlib.Path(path)
    prev = path.parent / f".{path.name}.prev"
    if not path.exists() and prev.exists():
        path = prev   # the last save was killed between its two renames: this is the previous checkpoint
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state: dict[str, Any] = {"meta": b"", "extra": b""}
    state.update({key: b"" for key in saved if key.startswith("checksums.")})
    entries = []
    if optimizer is not None:
        _check_optimizer(optimizer)
        entries = list(_optimizer_entries(optimizer, True))
        for k, *_, entry in entries:   # a checkpoint without the fp32 master: the master comes from the weights
            if "master" in entry and f"optim.state.{k}.master" not in saved:
                del entry["master"]
            elif "master" in entry:
                _master_as_saved(entry, saved[f"optim.state.{k}.master"].size)
        state["optim"] = {"state": {str(k): entry for k, *_, entry in entries}, "param_groups": b""}
    with _weights_held(model, optimizer, pull=True):
        if model is not None:
            state["model"] = _module(model).state_dict()    # tensors that alias the weights: loaded in place
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, planner=_LoadPlanner(allow_partial_load=not strict),
                     process_group=group, no_dist=not _distributed())
        _raise_on_any_rank(_verified(path, state), group)
    masters = [(bucket, i, entry["master"]) for _, _, bucket, i, entry in entries if "master" in entry]
    for bucket, i, master in masters:   # after the pull from the weights: the saved fp32 master wins
        bucket.before_host_write()
        _store_master(bucket, i, master)
        bucket.master_changed()
    if masters:
        optimizer.upload_buckets(optimizer.buckets)
    meta = _unpack(state["meta"]) if isinstance(state["meta"], bytes) else state["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a socompile sharded checkpoint (written by socompile.distributed.save)")
    if meta.get("version", 0) > VERSION:
        raise ValueError(f"{path} has format version {meta['version']}, newer than this socompile reads ({VERSION})")
    if optimizer is not None:
        groups = state["optim"]["param_groups"]
        groups = _unpack(groups) if isinstance(groups, bytes) else groups
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(f"the checkpoint has {len(groups)} param groups, the optimizer {len(optimizer.param_groups)}")
        for mine, saved in zip(optimizer.param_groups, groups):
            mine.update(saved)
        for _, p, bucket, i, entry in entries:
            bucket.steps[i] = int(float(entry["step"]))
            _encode_loaded(bucket, i, entry, bucket.steps[i])
            if bucket.steps[i] == 0:
                optimizer.state.pop(p, None)
                continue
            optimizer.state[p]["step"] = torch.tensor(float(bucket.steps[i]), dtype=torch.float32)
            alias_state(bucket, i, optimizer.state[p])
    extra = _unpack(state["extra"]) if isinstance(state["extra"], bytes) else state["extra"]
    return dict(extra or {})


# ---------------------------------------------------------------------------------------------- integrity
def _named_tensors(state: dict) -> list[tuple[str, Any]]:
    """(DCP key, tensor or _FlatPiece) for the model and optimizer entries of a save/load state dict."""
    named = [(f"model.{name}", value) for name, value in state.get("model", {}).items()]
    for k, entry in state.get("optim", {}).get("state", {}).items():
        named += [(f"optim.state.{k}.{key}", value) for key, value in entry.items()]
    return [(name, value) for name, value in named if isinstance(value, (torch.Tensor, _FlatPiece))]


def _checksums(state: dict, whole: bool) -> dict[str, tuple[int, int]]:
    """``{name: (crc32, numel)}`` of this rank's non-empty pieces (named ``key@offset``) and, when ``whole``,
    of the whole (replicated) tensors."""
    named = [(f"{name}@{value.offset}", value.local) if isinstance(value, _FlatPiece) else (name, value)
             for name, value in _named_tensors(state) if whole or isinstance(value, _FlatPiece)]
    named = [(name, tensor) for name, tensor in named if "@" not in name or tensor.numel()]
    sums = integrity._in_parallel(integrity.checksum, [tensor for _, tensor in named])
    return {name: (value, tensor.numel()) for (name, tensor), value in zip(named, sums)}


def _verified(path: pathlib.Path, state: dict) -> Exception | None:
    """The first problem of what this rank loaded: a checksum that differs, or optimizer values that cannot be
    right; None when all is well."""
    saved: dict[str, tuple[int, int]] = {}
    for key in [key for key in state if key.startswith("checksums.")]:
        saved.update(_unpack(state[key]) if isinstance(state[key], bytes) else state[key])
    if not saved:
        log.warning("sharded checkpoint %s was written by an older socompile without checksums: its tensors "
                    "cannot be verified (only their values are checked). Save it again to add checksums.", path)
    pieces: dict[str, list[tuple[int, int, int]]] = {}   # key -> (offset, numel, crc32) of the saved pieces
    for label, (crc, numel) in saved.items():
        key, at, offset = label.rpartition("@")
        if at:
            pieces.setdefault(key, []).append((int(offset), numel, crc))
    for name, value in _named_tensors(state):
        for label, tensor, crc in _checkable_parts(name, value, saved, pieces.get(name, [])):
            if integrity.checksum(tensor) != crc:
                return RuntimeError(f"sharded checkpoint {path} is corrupt: the bytes of {label} do not match the "
                                    "checksum written at save: they changed on disk or in a copy. Load an "
                                    "earlier checkpoint, or copy this one again from where it was written.")
        problem = _bad_optimizer_values(name, value)
        if problem:
            return ValueError(f"sharded checkpoint {path}: {name} {problem}. Load an earlier checkpoint.")
    return None


def _checkable_parts(name: str, value, saved: dict, pieces: list[tuple[int, int, int]]):
    """(label, tensor, saved crc32) for what this rank can recompute: a whole tensor, or the saved pieces
    that lie inside its own piece."""
    if not isinstance(value, _FlatPiece):   # whole: the tensor, or the pieces a device-sharded run saved of it
        if name in saved:
            return [(name, value, saved[name][0])]
        flat = value.reshape(-1)
        return [(f"{name}@{offset}", flat[offset:offset + numel], crc) for offset, numel, crc in pieces]
    start, stop = value.offset, value.offset + value.local.numel()
    return [(f"{name}@{offset}", value.local[offset - start:offset - start + numel], crc)
            for offset, numel, crc in pieces if start <= offset and offset + numel <= stop]


def _bad_optimizer_values(name: str, value) -> str | None:
    key = name.rpartition(".")[2]
    tensor = value.local if isinstance(value, _FlatPiece) else value
    if not name.startswith("optim.state."):
        return None
    if key == "step":
        if not integrity.is_step_count(tensor):
            return f"is {float(tensor)!r}; a step count must be a non-negative integer"
        return None
    return integrity.bad_values(tensor, nonnegative=key == "exp_avg_sq")


def _raise_on_any_rank(problem: Exception | None, group) -> None:
    """Every rank raises when one found a problem (the others would wait for it in the next collective)."""
    if _distributed():
        found = [None] * dist.get_world_size(group)
        mine = None if problem is None else (type(problem).__name__, str(problem))
        dist.all_gather_object(found, mine, group=group)
        first = next(((rank, item) for rank, item in enumerate(found) if item is not None), None)
        if first is not None:
            rank, (kind, message) = first
            raise (ValueError if kind == "ValueError" else RuntimeError)(f"rank {rank}: {message}")
    elif problem is not None:
        raise problem


# ------------------------------------------------------------------------------------------------ interop
@torch.no_grad()
def full_optimizer_state_dict(optimizer, *, to_rank: int = 0, group=None) -> dict | None:
    """torch.optim.AdamW's state_dict layout (whole moments), gathered on group rank ``to_rank``; None on the
    other ranks. Every rank calls it. Costs one full copy of the moments on ``to_rank``: for interoperation
    (``torch.optim.AdamW.load_state_dict``, ``socompile.save``), not for routine checkpoints."""
    _check_optimizer(optimizer)
    optimizer.wait_pending()
    sharding = optimizer.sharding
    if sharding is None or sharding.world == 1:
        return optimizer.state_dict()
    group = sharding.group if group is None else group
    me = dist.get_rank(group)
    dst = dist.get_global_rank(group, to_rank) if group is not None else to_rank
    index_of = {id(p): k for k, p in enumerate(optimizer.all_params())}
    state: dict[int, dict] = {}
    for bucket in optimizer.buckets:   # the same order on every rank
        shard = sharding.shard_of(bucket)
        chunk = bucket.moment_buffer_elements(shard.chunk)   # int8: bytes of whole blocks, which concatenate
        whole = []
        for local in (bucket.exp_avg, bucket.exp_avg_sq):
            mine = torch.zeros(chunk, dtype=local.dtype)
            mine[:local.numel()].copy_(local)
            parts = [torch.empty(chunk, dtype=local.dtype) for _ in range(sharding.world)] if me == to_rank else None
            dist.gather(mine, parts, dst=dst, group=group)
            whole.append(torch.cat(parts)[:bucket.moment_buffer_elements(bucket.numel)] if parts is not None else None)
        if me != to_rank:
            continue
        for i, p in enumerate(bucket.params):
            if bucket.steps[i] == 0:
                continue
            exp_avg, exp_avg_sq = bucket.whole_moment_values(i, *whole)
            state[index_of[id(p)]] = {"step": torch.tensor(float(bucket.steps[i]), dtype=torch.float32),
                                      "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if me != to_rank:
        return None
    groups = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]   # torch's param index lists
    return {"state": dict(sorted(state.items())), "param_groups": [_torch_group(g) for g in groups]}


def _torch_group(group: dict) -> dict:
    from ..optim.adamw import torch_param_group
    return torch_param_group(group)
