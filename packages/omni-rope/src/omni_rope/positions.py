"""Qwen3-Omni TM-RoPE position ids, vectorised and bit-identical to transformers' reference.

This is the pure core every model wrapper calls (the HF Qwen3-VL override in ``omni_rope.hf_vl``, a
Megatron model later): ``(input_ids, attention_mask, grids, seconds per grid, audio lengths) ->
(positions [3,B,L] float32, deltas [B,1] float32)``, exactly what
``Qwen3OmniMoeThinkerForConditionalGeneration.get_rope_index`` returns for well-formed inputs.

How it stays identical without the reference's per-token Python walk:

* The valid tokens of all rows are flattened; media segments are found from their start markers and
  their extents come from the grids / audio lengths (as the reference does), then every token is checked
  against the layout those extents imply, so malformed prompts raise instead of shifting positions.
* The reference builds positions in float32, piece by piece, each piece starting at ``max(previous
  piece) + 1``. Where ``second_per_grid * position_id_per_seconds`` is fractional those additions round,
  so the chain of piece starts is replayed with the same float32 operations in the same order - one
  step per segment *ordinal*, vectorised over the batch (a handful of segments per row in practice).
  Quirk kept on purpose: after an audio-in-video block whose last merged token is audio, the reference
  restarts at ``last audio position + 1`` even when the video's height/width positions went higher.
* Audio-in-video interleaving (the reference's per-token two-pointer merge) is one stable sort of
  all interleaved blocks at once: by time, then by block, video before audio on ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_rope.audio import audio_output_length
from omni_rope.config import OmniRopeConfig
from omni_rope.errors import OmniRopeError

# Token kinds.
TEXT, VS, VE, AS, AE, IMG, VID, AUD = range(8)
KIND_FIELDS: tuple[tuple[int, str], ...] = (
    (VS, "vision_start_token_id"),
    (VE, "vision_end_token_id"),
    (AS, "audio_start_token_id"),
    (AE, "audio_end_token_id"),
    (IMG, "image_token_id"),
    (VID, "video_token_id"),
    (AUD, "audio_token_id"),
)
# Segment kinds.
IMAGE, VIDEO, AIV, AUDIO = range(4)
SEGMENT_NAMES = {IMAGE: "image", VIDEO: "video", AIV: "audio-in-video", AUDIO: "audio"}
# Piece roles inside a row: text before a segment, its start marker(s), body, end marker(s).
R_TEXT, R_BOS, R_BODY, R_EOS = range(4)
# Batches up to this many token slots on an accelerator are computed on the host (see get_rope_index).
HOST_MAX_TOKENS = 1 << 14  # H200 + 16-core host: 8x1356 slots 3.9 vs 5.5 ms, 64x1916 32 vs 5.7 ms
ANY_AV = -1  # expected kind "video or audio placeholder" (interleaved body)
# Expected token kind per (role, segment kind, offset within a 2-token marker pair).
EXPECTED_KIND: dict[tuple[int, int], tuple[int, int]] = {
    (R_BOS, IMAGE): (VS, VS),
    (R_BOS, VIDEO): (VS, VS),
    (R_BOS, AIV): (VS, AS),
    (R_BOS, AUDIO): (AS, AS),
    (R_BODY, IMAGE): (IMG, IMG),
    (R_BODY, VIDEO): (VID, VID),
    (R_BODY, AIV): (ANY_AV, ANY_AV),
    (R_BODY, AUDIO): (AUD, AUD),
    (R_EOS, IMAGE): (VE, VE),
    (R_EOS, VIDEO): (VE, VE),
    (R_EOS, AIV): (AE, VE),
    (R_EOS, AUDIO): (AE, AE),
}


def get_rope_index(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: OmniRopeConfig,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grids: torch.Tensor | Sequence[float] | None = None,
    audio_seqlens: torch.Tensor | Sequence[int] | None = None,
    use_audio_in_video: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Omni TM-RoPE positions ``[3,B,L]`` (float32) and decode deltas ``[B,1]`` (float32).

    Grids, ``second_per_grids`` (one per video) and ``audio_seqlens`` (mel frames per audio,
    ``feature_attention_mask.sum(-1)``) list the media of the whole batch in row-major order; an
    audio-in-video item counts as one video and one audio. ``attention_mask=None`` means no padding.

    ``use_audio_in_video`` must describe every video of the batch: ``False`` (plain videos only),
    ``True`` (every video carries its audio, ``<vision_start><audio_start>...``), or ``None`` to read
    it per video from the tokens (for mixed batches, which the reference cannot position).

    As in the reference, the 3-D rule runs only when ``image_grid_thw`` or ``video_grid_thw`` is
    given; otherwise positions are ``cumsum(mask) - 1`` with padding at 1.
    """
    if input_ids.device.type != "cpu" and input_ids.numel() <= HOST_MAX_TOKENS:
        # Small batches are a few hundred tiny ops: on an accelerator their launches and syncs cost
        # more than the work, so run them on the host and ship the result back (same float32 ops,
        # same bits; the CUDA test checks it).
        def host(x: Any) -> Any:
            return x.cpu() if isinstance(x, torch.Tensor) else x

        pos, deltas = get_rope_index(
            input_ids.cpu(),
            host(attention_mask),
            config,
            image_grid_thw=host(image_grid_thw),
            video_grid_thw=host(video_grid_thw),
            second_per_grids=host(second_per_grids),
            audio_seqlens=host(audio_seqlens),
            use_audio_in_video=use_audio_in_video,
        )
        return pos.to(input_ids.device), deltas.to(input_ids.device)
    input_ids, mask = _check_ids_and_mask(input_ids, attention_mask)
    flat = _Flat.build(input_ids, mask, config)
    media = _Media.build(
        flat,
        config,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        second_per_grids=second_per_grids,
        audio_seqlens=audio_seqlens,
        use_audio_in_video=use_audio_in_video,
    )
    if image_grid_thw is None and video_grid_thw is None:
        if media.num_segments:
            # Validate the audio layout (no position depends on it in this branch).
            _layout(flat, media, config)
        return _sequential_positions(mask)
    return _positions_3d(flat, media, config)


# --------------------------------------------------------------------------- inputs


def _check_ids_and_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise OmniRopeError(f"input_ids: expected a [batch, seq] tensor, got {got}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise OmniRopeError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids, dtype=torch.bool)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise OmniRopeError(
            f"attention_mask: expected shape {tuple(input_ids.shape)} like input_ids, got "
            f"{tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(input_ids.device)
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise OmniRopeError("attention_mask: expected only 0/1 values")
        mask = mask == 1
    return input_ids, mask


class _Flat:
    """The valid tokens of all rows, concatenated row after row, with their kinds."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, kind: torch.Tensor) -> None:
        self.mask = mask
        self.ids = ids
        self.kind = kind
        self.lengths = mask.sum(1)
        self.row_start = torch.cumsum(self.lengths, 0) - self.lengths
        self.row = torch.repeat_interleave(
            torch.arange(mask.shape[0], device=ids.device), self.lengths, output_size=ids.numel()
        )
        self._cols: list[int] | None = None

    @classmethod
    def build(cls, input_ids: torch.Tensor, mask: torch.Tensor, config: OmniRopeConfig) -> _Flat:
        ids = input_ids[mask]
        kind = torch.zeros_like(ids, dtype=torch.long)
        for code, field in KIND_FIELDS:
            kind.masked_fill_(ids == getattr(config, field), code)
        return cls(ids, mask, kind)

    @property
    def n(self) -> int:
        return self.ids.numel()

    def where(self, flat_index: int) -> tuple[int, int]:
        """(row, column in input_ids) of a flat token index - for error messages only."""
        if self._cols is None:
            self._cols = self.mask.nonzero()[:, 1].tolist()
        return int(self.row[flat_index]), self._cols[flat_index]


def _as_1d(values: Any, dtype: torch.dtype, name: str, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(values).to(device)
    if t.ndim == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.ndim != 1:
        raise OmniRopeError(
            f"{name}: expected a 1-D list (one entry per item), got shape {tuple(t.shape)}"
        )
    return t if t.dtype == dtype or dtype is None else t.to(dtype)


class _Media:
    """Segments found in the tokens, matched to the batch-global grids / seconds / audio lengths."""

    @classmethod
    def build(
        cls,
        flat: _Flat,
        config: OmniRopeConfig,
        *,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        second_per_grids: Any,
        audio_seqlens: Any,
        use_audio_in_video: bool | None,
    ) -> _Media:
        self = cls()
        dev = flat.ids.device
        kind = flat.kind
        n = flat.n
        first = torch.zeros(n, dtype=torch.bool, device=dev)
        last = torch.zeros(n, dtype=torch.bool, device=dev)
        nonempty = flat.lengths > 0
        first[flat.row_start[nonempty]] = True
        last[(flat.row_start + flat.lengths - 1)[nonempty]] = True
        prev_kind = torch.roll(kind, 1).masked_fill(first, TEXT)
        next_kind = torch.roll(kind, -1).masked_fill(last, -1)

        starts = (kind == VS) | ((kind == AS) & (prev_kind != VS))
        pos = starts.nonzero().squeeze(1)
        nk = next_kind[pos]
        is_vs = kind[pos] == VS
        seg_kind = torch.full_like(pos, AUDIO)
        seg_kind[is_vs & (nk == IMG)] = IMAGE
        seg_kind[is_vs & (nk == VID)] = VIDEO
        seg_kind[is_vs & (nk == AS)] = AIV
        bad_vs = is_vs & (nk != IMG) & (nk != VID) & (nk != AS)
        self.pos, self.kind = pos, seg_kind
        self.num_segments = pos.numel()

        counts = torch.stack(
            [
                bad_vs.sum(),
                (seg_kind == IMAGE).sum(),
                (seg_kind == VIDEO).sum(),
                (seg_kind == AIV).sum(),
                (seg_kind == AUDIO).sum(),
                ((kind == IMG) | (kind == VID) | (kind == AUD)).sum(),
            ]
        ).tolist()
        n_bad_vs, n_img, n_vid_plain, n_aiv, n_aud_plain, n_placeholders = counts
        if n_bad_vs:
            i = int(pos[bad_vs][0])
            b, c = flat.where(i)
            after = (
                "the end of the row"
                if int(nk[bad_vs][0]) == -1
                else f"token {int(flat.ids[i + 1])}"
            )
            raise OmniRopeError(
                f"row {b}, column {c}: <vision_start> ({config.vision_start_token_id}) is followed by "
                f"{after}; expected an image ({config.image_token_id}), video ({config.video_token_id}) "
                f"or audio-start ({config.audio_start_token_id}) token"
            )
        if n_placeholders and not self.num_segments:
            i = int(((kind == IMG) | (kind == VID) | (kind == AUD)).nonzero()[0])
            b, c = flat.where(i)
            raise OmniRopeError(
                f"row {b}, column {c}: media placeholder {int(flat.ids[i])} outside any media segment "
                "(missing <vision_start>/<audio_start> token before it)"
            )
        if use_audio_in_video is False and n_aiv:
            b, c = flat.where(int(pos[seg_kind == AIV][0]))
            raise OmniRopeError(
                f"row {b}, column {c}: audio-in-video segment (<vision_start><audio_start>) but "
                "use_audio_in_video=False; pass True (or None to detect it per video)"
            )
        if use_audio_in_video is True and n_vid_plain:
            b, c = flat.where(int(pos[seg_kind == VIDEO][0]))
            raise OmniRopeError(
                f"row {b}, column {c}: video without audio but use_audio_in_video=True (the reference "
                "then positions that video as text); pass None to detect audio per video"
            )

        m = config.spatial_merge_size
        self.n_images, self.n_videos, self.n_audios = (
            n_img,
            n_vid_plain + n_aiv,
            n_aud_plain + n_aiv,
        )
        img_grid = _grids(image_grid_thw, n_img, m, "image_grid_thw", "image", dev)
        vid_grid = _grids(video_grid_thw, self.n_videos, m, "video_grid_thw", "video", dev)

        is_img = seg_kind == IMAGE
        is_vid = (seg_kind == VIDEO) | (seg_kind == AIV)
        is_aud = (seg_kind == AUDIO) | (seg_kind == AIV)
        grid = torch.zeros(self.num_segments, 3, dtype=torch.long, device=dev)
        if n_img:
            grid[is_img] = img_grid
        if self.n_videos:
            grid[is_vid] = vid_grid
        self.T = grid[:, 0]
        self.Hp = grid[:, 1] // m
        self.Wp = grid[:, 2] // m
        self.grid = grid
        self.item_index = torch.where(
            is_img, torch.cumsum(is_img, 0) - 1, torch.cumsum(is_vid, 0) - 1
        )
        self.audio_index = torch.cumsum(is_aud, 0) - 1

        self.spg = torch.zeros(self.num_segments, dtype=torch.float32, device=dev)
        if self.n_videos:
            if second_per_grids is None:
                raise OmniRopeError(
                    f"the batch has {self.n_videos} video(s) but no second_per_grids "
                    "(video_second_per_grid = temporal_patch_size / sampled fps, one per video)"
                )
            spg = _as_1d(second_per_grids, None, "second_per_grids", dev)
            if spg.numel() != self.n_videos:
                raise OmniRopeError(
                    f"second_per_grids: expected one entry per video ({self.n_videos}), got {spg.numel()}"
                )
            # As the reference: each entry is taken to float32 before use.
            spg = spg.float()
            if not bool(torch.isfinite(spg).all() & (spg >= 0).all()):
                raise OmniRopeError(
                    f"second_per_grids: expected finite values >= 0, got {spg.tolist()}"
                )
            self.spg[is_vid] = spg
        self.na = torch.zeros(self.num_segments, dtype=torch.long, device=dev)
        if self.n_audios:
            if audio_seqlens is None:
                raise OmniRopeError(
                    f"the batch has {self.n_audios} audio segment(s) but no audio_seqlens "
                    "(mel frames per audio, feature_attention_mask.sum(-1))"
                )
            frames = _as_1d(audio_seqlens, torch.long, "audio_seqlens", dev)
            if frames.numel() != self.n_audios:
                raise OmniRopeError(
                    f"audio_seqlens: expected one entry per audio ({self.n_audios}: "
                    f"{n_aud_plain} audio, {n_aiv} audio-in-video), got {frames.numel()}"
                )
            if bool((frames < 1).any()):
                raise OmniRopeError(
                    f"audio_seqlens: every audio needs >= 1 mel frame, got {frames.tolist()}"
                )
            self.na[is_aud] = audio_output_length(frames, n_window=config.audio_n_window)
        self.nv = self.T * self.Hp * self.Wp
        self.is_aiv = seg_kind == AIV
        self.bos = 1 + self.is_aiv.long()
        self.body = self.nv + self.na
        self.length = self.bos + self.body + self.bos
        return self

    def describe(self, s: int, config: OmniRopeConfig) -> str:
        k = int(self.kind[s])
        name = SEGMENT_NAMES[k]
        if k == AUDIO:
            return f"audio #{int(self.audio_index[s])} ({int(self.na[s])} audio placeholders)"
        grid = self.grid[s].tolist()
        token = "image" if k == IMAGE else "video"
        what = f"{name} #{int(self.item_index[s])} (grid {grid} -> {int(self.nv[s])} {token} placeholders"
        if k == AIV:
            what += f" + {int(self.na[s])} audio placeholders of audio #{int(self.audio_index[s])}"
        return what + ")"


def _grids(
    grid: torch.Tensor | None, expected: int, merge: int, name: str, what: str, dev: torch.device
) -> torch.Tensor:
    if grid is None:
        if expected:
            raise OmniRopeError(f"the batch has {expected} {what} segment(s) but {name} is None")
        return torch.zeros(0, 3, dtype=torch.long, device=dev)
    g = torch.as_tensor(grid).to(dev)
    if g.ndim != 2 or g.shape[1] != 3 or g.dtype.is_floating_point:
        raise OmniRopeError(
            f"{name}: expected an integer [n, 3] tensor, got {tuple(g.shape)} {g.dtype}"
        )
    if g.shape[0] != expected:
        raise OmniRopeError(
            f"{name}: {g.shape[0]} grid(s) but the input_ids hold {expected} {what} segment(s)"
        )
    g = g.long()
    bad = (g < 1).any(1) | (g[:, 1] % merge != 0) | (g[:, 2] % merge != 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise OmniRopeError(
            f"{name}[{i}] = {g[i].tolist()}: expected positive sizes with h and w divisible by "
            f"spatial_merge_size {merge}"
        )
    return g


# --------------------------------------------------------------------------- layout


class _Layout:
    """Every valid token's piece (text / start marker / body / end marker) and offset in it."""

    tok_piece: torch.Tensor
    off: torch.Tensor
    role: torch.Tensor
    seg: torch.Tensor
    n_rows: int
    s_max: int
    seg_row: torch.Tensor
    seg_ord: torch.Tensor
    text_len: torch.Tensor
    trailing_len: torch.Tensor


def _layout(flat: _Flat, media: _Media, config: OmniRopeConfig) -> _Layout:
    """Place segments in rows, check extents and token kinds, and index every token's piece."""
    dev = flat.ids.device
    B = flat.mask.shape[0]
    S = media.num_segments
    lay = _Layout()
    seg_row = flat.row[media.pos] if S else torch.zeros(0, dtype=torch.long, device=dev)
    seg_end = media.pos + media.length
    row_end = flat.row_start + flat.lengths
    same_prev = torch.zeros(S, dtype=torch.bool, device=dev)
    if S > 1:
        same_prev[1:] = seg_row[1:] == seg_row[:-1]
    prev_end = torch.where(same_prev, torch.roll(seg_end, 1), flat.row_start[seg_row])
    text_len = media.pos - prev_end
    count = torch.bincount(seg_row, minlength=B)
    seg_first = torch.cumsum(count, 0) - count
    seg_ord = torch.arange(S, device=dev) - seg_first[seg_row]
    last_end = flat.row_start.clone()
    has_seg = count > 0
    last_end[has_seg] = seg_end[(seg_first + count - 1)[has_seg]]
    trailing = row_end - last_end

    checks = torch.stack(
        [
            (text_len < 0).sum(),
            (trailing < 0).sum(),
            count.max() if B else torch.zeros((), dtype=torch.long, device=dev),
        ]
    ).tolist()
    if checks[0] or checks[1]:
        _raise_overrun(flat, media, config, text_len, trailing, seg_row, count, seg_first)
    lay.n_rows, lay.s_max = B, int(checks[2])
    lay.seg_row, lay.seg_ord, lay.text_len, lay.trailing_len = seg_row, seg_ord, text_len, trailing

    # Pieces per row: [text, bos, body, eos] x s_max, then the trailing text.
    W = 4 * lay.s_max + 1
    plen = torch.zeros(B, W, dtype=torch.long, device=dev)
    pseg = torch.full((B, W), -1, dtype=torch.long, device=dev)
    if S:
        col = 4 * seg_ord
        plen[seg_row, col] = text_len
        plen[seg_row, col + 1] = media.bos
        plen[seg_row, col + 2] = media.body
        plen[seg_row, col + 3] = media.bos
        for r in range(1, 4):
            pseg[seg_row, col + r] = torch.arange(S, device=dev)
    plen[:, -1] = trailing
    lay.plen = plen
    flat_plen = plen.reshape(-1)
    P = flat_plen.numel()
    tok_piece = torch.repeat_interleave(torch.arange(P, device=dev), flat_plen, output_size=flat.n)
    pfirst = torch.cumsum(flat_plen, 0) - flat_plen
    lay.tok_piece = tok_piece
    lay.off = torch.arange(flat.n, device=dev) - pfirst[tok_piece]
    lay.role = (tok_piece % W) % 4  # the trailing piece (index 4*s_max) comes out as R_TEXT
    lay.seg = pseg.reshape(-1)[tok_piece]

    # Token kinds must be what the extents imply.
    lut = torch.full((4, 4, 2), TEXT, dtype=torch.long, device=dev)
    for (role, sk), pair in EXPECTED_KIND.items():
        lut[role, sk] = torch.tensor(pair, device=dev)
    seg_c = lay.seg.clamp(min=0)
    skind = media.kind[seg_c] if S else torch.zeros_like(seg_c)
    expected = lut[lay.role, skind, lay.off.clamp(max=1)]
    kind = flat.kind
    bad = torch.where(expected == ANY_AV, (kind != VID) & (kind != AUD), kind != expected)
    vid_count_bad = torch.zeros((), dtype=torch.bool, device=dev)
    if S:
        in_aiv_video = (expected == ANY_AV) & (kind == VID)
        got_v = torch.bincount(lay.seg[in_aiv_video], minlength=S)
        vid_count_bad = (media.is_aiv & (got_v != media.nv)).any()
    if bool(bad.any() | vid_count_bad):
        _raise_bad_tokens(flat, media, config, lay, expected, bad)
    lay.skind = skind
    return lay


def _token_name(tok: int, config: OmniRopeConfig) -> str:
    for _, field in KIND_FIELDS:
        if getattr(config, field) == tok:
            return f"{field.removesuffix('_id')} {tok}"
    return f"text token {tok}"


_KIND_NAMES = {
    TEXT: "a text token",
    VS: "vision_start_token",
    VE: "vision_end_token",
    AS: "audio_start_token",
    AE: "audio_end_token",
    IMG: "image_token",
    VID: "video_token",
    AUD: "audio_token",
    ANY_AV: "a video or audio token",
}


def _run_length(flat: _Flat, start: int, kinds: tuple[int, ...]) -> int:
    """How many tokens of ``kinds`` follow ``start`` in its row (diagnostics only)."""
    row_end = int(flat.row_start[flat.row[start]] + flat.lengths[flat.row[start]])
    ks = flat.kind[start:row_end].tolist()
    n = 0
    for k in ks:
        if k not in kinds:
            break
        n += 1
    return n


def _body_kinds(seg_kind: int) -> tuple[int, ...]:
    return {IMAGE: (IMG,), VIDEO: (VID,), AUDIO: (AUD,), AIV: (VID, AUD)}[seg_kind]


def _raise_overrun(flat, media, config, text_len, trailing, seg_row, count, seg_first) -> None:
    bad = (text_len < 0).nonzero()
    if bad.numel():
        s = int(bad[0]) - 1  # the previous segment runs into this one
        nxt = f"the next segment at column {flat.where(int(media.pos[s + 1]))[1]}"
    else:
        b = int((trailing < 0).nonzero()[0])
        s = int(seg_first[b] + count[b] - 1)
        nxt = "the end of the row"
    _raise_segment_mismatch(flat, media, config, s, f"runs past {nxt}")


def _raise_segment_mismatch(flat, media, config, s: int, problem: str) -> None:
    start = int(media.pos[s])
    b, c = flat.where(start)
    body_at = start + int(media.bos[s])
    found = _run_length(flat, body_at, _body_kinds(int(media.kind[s])))
    found_v = None
    if int(media.kind[s]) == AIV:
        row_end = int(flat.row_start[b] + flat.lengths[b])
        ks = flat.kind[body_at : min(row_end, body_at + found)]
        found_v = int((ks == VID).sum())
    detail = f"found {found} placeholder(s)"
    if found_v is not None:
        detail += f" ({found_v} video, {found - found_v} audio)"
    raise OmniRopeError(
        f"row {b}, column {c}: {media.describe(s, config)} {problem}: {detail}. Grid / audio "
        "length and placeholder count disagree"
    )


def _raise_bad_tokens(flat, media, config, lay, expected, bad) -> None:
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        s = int(lay.seg[i])
        b, c = flat.where(i)
        want = _KIND_NAMES[int(expected[i])]
        if s < 0:
            raise OmniRopeError(
                f"row {b}, column {c}: {_token_name(int(flat.ids[i]), config)} outside any media "
                "segment (missing start marker, or an extra end marker/placeholder)"
            )
        _raise_segment_mismatch(
            flat,
            media,
            config,
            s,
            f"does not match the tokens (column {c} should be {want}, is "
            f"{_token_name(int(flat.ids[i]), config)})",
        )
    for s in media.is_aiv.nonzero().squeeze(1).tolist():
        body_at = int(media.pos[s] + media.bos[s])
        ks = flat.kind[body_at : body_at + int(media.body[s])]
        if int((ks == VID).sum()) != int(media.nv[s]):
            _raise_segment_mismatch(flat, media, config, s, "has the wrong video/audio split")


# --------------------------------------------------------------------------- positions


def _sequential_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's branch without image/video grids: 1-D positions, padding at 1."""
    pos = mask.float().cumsum(-1) - 1
    pos.masked_fill_(~mask, 1)
    pos = pos.unsqueeze(0).expand(3, -1, -1).contiguous()
    max_pos = pos.max(0)[0].max(-1, keepdim=True)[0]
    return pos, max_pos + 1 - mask.sum(-1, keepdim=True)


def _vision_rel(
    media: _Media, seg: torch.Tensor, off: torch.Tensor, pps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Relative (t, h, w) of vision tokens ``off`` of segments ``seg``, with the reference's float ops."""
    hp, wp = media.Hp[seg], media.Wp[seg]
    hw = hp * wp
    k = off // hw
    rem = off - k * hw
    r = rem // wp
    c = rem - r * wp
    # Images: arange(t) * 1 * pps (integer when pps is); videos: arange(t) * float32(spg) * pps.
    t_img = (k * 1 * pps).float()
    t_vid = k.float() * media.spg[seg] * pps
    t = torch.where(media.kind[seg] == IMAGE, t_img, t_vid)
    return t, r.float(), c.float()


def _positions_3d(
    flat: _Flat, media: _Media, config: OmniRopeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    dev = flat.ids.device
    pps = config.position_id_per_seconds
    lay = _layout(flat, media, config)
    B, S = lay.n_rows, media.num_segments

    # Relative extremes of each segment's body, as float32.
    last_t = torch.zeros(S, dtype=torch.float32, device=dev)
    if S:
        last = (media.T - 1).clamp(min=0)
        img = media.kind == IMAGE
        last_t = torch.where(img, (last * 1 * pps).float(), last.float() * media.spg * pps)
    vis_max = torch.maximum(last_t, torch.maximum((media.Hp - 1).float(), (media.Wp - 1).float()))
    aud_last = (media.na - 1).float()
    rel_max = torch.where(media.kind == AUDIO, aud_last, vis_max)

    # Replay the reference's float32 chain of piece starts, one segment ordinal at a time.
    def dense(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        out = torch.full((B, lay.s_max), fill, dtype=torch.float32, device=dev)
        out[lay.seg_row, lay.seg_ord] = x.float()
        return out

    d_text, d_bos = dense(lay.text_len), dense(media.bos)
    d_rel, d_aud, d_last_t = dense(rel_max), dense(aud_last), dense(last_t)
    d_aiv = torch.zeros(B, lay.s_max, dtype=torch.bool, device=dev)
    d_aiv[lay.seg_row, lay.seg_ord] = media.is_aiv
    d_active = torch.zeros(B, lay.s_max, dtype=torch.bool, device=dev)
    d_active[lay.seg_row, lay.seg_ord] = True
    any_aiv = bool(media.is_aiv.any()) if S else False
    starts = torch.zeros(B, lay.s_max, 4, dtype=torch.float32, device=dev)
    cur = torch.zeros(B, dtype=torch.float32, device=dev)
    for s in range(lay.s_max):
        after_text = cur + d_text[:, s]
        body_start = after_text + d_bos[:, s]
        body_max = d_rel[:, s] + body_start
        if any_aiv:
            a_last = d_aud[:, s] + body_start
            audio_tail = d_aiv[:, s] & (a_last >= d_last_t[:, s] + body_start)
            body_max = torch.where(audio_tail, a_last, body_max)
        eos_start = body_max + 1
        nxt = ((d_bos[:, s] - 1) + eos_start) + 1
        starts[:, s] = torch.stack([cur, after_text, body_start, eos_start], dim=1)
        cur = torch.where(d_active[:, s], nxt, cur)
    pstart = torch.cat([starts.reshape(B, -1), cur[:, None]], dim=1).reshape(-1)

    # Every token: position = float32(relative value + piece start), as the reference adds them.
    start = pstart[lay.tok_piece]
    rel = lay.off.float().expand(3, -1).clone()
    body = lay.role == R_BODY
    vis = body & ((lay.skind == IMAGE) | (lay.skind == VIDEO))
    if bool(vis.any()):
        t, h, w = _vision_rel(media, lay.seg[vis], lay.off[vis], pps)
        rel[:, vis] = torch.stack([t, h, w])
    pos = rel + start
    if any_aiv:
        aiv_tok = body & (lay.skind == AIV)
        pos[:, aiv_tok] = _merge_audio_in_video(media, starts, lay, pps)

    positions = torch.zeros(3, *flat.mask.shape, dtype=torch.float32, device=dev)
    positions[:, flat.mask] = pos
    row_max = torch.zeros(B, dtype=torch.float32, device=dev).scatter_reduce(
        0, flat.row, pos.amax(0), "amax", include_self=False
    )
    deltas = torch.where(
        flat.lengths > 0, (row_max + 1) - flat.lengths.float(), torch.zeros_like(row_max)
    )
    return positions, deltas[:, None]


def _merge_audio_in_video(
    media: _Media, starts: torch.Tensor, lay: _Layout, pps: float
) -> torch.Tensor:
    """Absolute positions of all interleaved bodies, in the reference's merge order, concatenated."""
    dev = starts.device
    aiv = media.is_aiv.nonzero().squeeze(1)
    body_start = starts[lay.seg_row[aiv], lay.seg_ord[aiv], 2]
    nv, na = media.nv[aiv], media.na[aiv]
    a = torch.arange(aiv.numel(), device=dev)
    v_local = torch.repeat_interleave(a, nv)
    v_off = torch.arange(v_local.numel(), device=dev) - (torch.cumsum(nv, 0) - nv)[v_local]
    t, h, w = _vision_rel(media, aiv[v_local], v_off, pps)
    vb = body_start[v_local]
    video = torch.stack([t + vb, h + vb, w + vb])
    a_local = torch.repeat_interleave(a, na)
    a_off = torch.arange(a_local.numel(), device=dev) - (torch.cumsum(na, 0) - na)[a_local]
    audio = (a_off.float() + body_start[a_local]).expand(3, -1)
    values = torch.cat([video, audio], dim=1)
    owner = torch.cat([v_local, a_local])
    # Stable sorts: by time (video listed first, so it wins ties), then by block.
    by_time = torch.sort(values[0], stable=True).indices
    by_block = torch.sort(owner[by_time], stable=True).indices
    return values[:, by_time[by_block]]
