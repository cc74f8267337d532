"""``splitvl cache-eval``: calibrate the similarity tier on labelled image pairs.

A similarity hit hands the decoder another image's embeddings, so a false hit silently
answers about the wrong picture. This measures the cache's whole rule on two labelled sets,
all offline:

* near duplicates (should hit): every bundled scikit-image photo against its own JPEG
  re-encodes (quality 70-95), resizes (1-10%, down and up), crops (1-3%, reported apart),
  brightness and contrast shifts (3-5%), PNG<->JPEG round trips and two combinations;
* distinct pairs (must never hit): all pairs of the bundled photos (including the stereo
  pair ``motorcycle_left``/``motorcycle_right``), rendered text one digit or word apart, and
  adversarial pairs built to share a thumbnail: receipt and invoice photos one digit
  apart, photographed pages and screenshots one character apart at several text sizes, a
  spreadsheet one cell apart, bar charts one bar apart, i.i.d. random-pixel images (vLLM's
  benchmark images), and the 32x32-average poisoning construction.

Every image goes through the gateway's own pipeline (encoded bytes -> ``decode_image`` ->
``plan_resize``, ``similarity_descriptor``, ``reusable_grids`` and ``verification_image``),
and a pair hits as the cache decides: cosine >= threshold, the stored grid equal to the
query's or within its grid-change bound (:mod:`vlcommon.grid_reuse`), and the verification
(:func:`vlcommon.verification.verification_residual` within the tolerance).

Usage::

    splitvl cache-eval                 # table over thresholds 0.80-0.99, tiny budget
    splitvl cache-eval --min-pixels 65536 --max-pixels 16777216   # Qwen3-VL's budget
    splitvl cache-eval --json          # {"false_hits", "recall_without_crops", ...}
    splitvl cache-eval --model DIR     # that checkpoint's pixel budget
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFont

from splitvl.argtypes import cosine, positive_int
from vlcommon.grid_reuse import DEFAULT_GRID_REUSE_SCALE, reusable_grids
from vlcommon.imaging import (
    DESCRIPTOR_SIDE,
    cosine_similarity,
    decode_image,
    plan_resize,
    similarity_descriptor,
)
from vlcommon.model_info import VisionSpec
from vlcommon.verification import (
    VERIFY_TOLERANCE,
    VerificationImage,
    jpeg_matched_score,
    verifiable,
    verification_image,
    verification_residual,
)

# The scikit-image images that ship inside the wheel (skimage.data loads them without the
# network; astronaut, brick, camera, cell, chelsea (cat), checkerboard, clock, coffee,
# coins, colorwheel, grass, gravel, horse, hubble_deep_field, immunohistochemistry, logo,
# microaneurysms, moon, page, retina, rocket, shepp_logan_phantom, stereo_motorcycle and
# text; the others are fetched with pooch). Files, so no network call is ever attempted.
PHOTOS = (
    "astronaut.png",
    "brick.png",
    "camera.png",
    "cell.png",
    "chelsea.png",
    "chessboard_GRAY.png",
    "clock_motion.png",
    "coffee.png",
    "coins.png",
    "color.png",
    "grass.png",
    "gravel.png",
    "horse.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "logo.png",
    "microaneurysms.png",
    "moon.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "page.png",
    "phantom.png",
    "retina.jpg",
    "rocket.jpg",
    "text.png",
)
DESCRIPTOR_CELLS = DESCRIPTOR_SIDE  # the thumbnail grid the poisoning construction copies
# A reduced set for the unit test: colour and grey, photos and textures, the stereo pair.
QUICK_PHOTOS = (
    "astronaut.png",
    "camera.png",
    "chelsea.png",
    "coffee.png",
    "gravel.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "page.png",
    "rocket.jpg",
)
# (text a, text b): one digit or one word apart. Rendered as one-line labels, multi-line
# notes and receipts (see _render_text), so the changed glyph covers from ~1% to ~15% of
# the ink.
TEXT_PAIRS = (
    ("Total: $1,234.56", "Total: $1,234.58"),
    ("Room 214", "Room 215"),
    ("Flight LH 4821\nGate B12\nBoarding 09:40", "Flight LH 4821\nGate B13\nBoarding 09:40"),
    ("Invoice 2026-0417\nAmount due: 870.00 EUR", "Invoice 2026-0417\nAmount due: 810.00 EUR"),
    ("The door is open", "The door is closed"),
    ("Turn left at the bridge", "Turn right at the bridge"),
    ("Do not press the red button", "Do press the red button"),
    ("Dose: 5 mg twice daily", "Dose: 50 mg twice daily"),
    ("Meeting moved to Tuesday\nRoom 3, 2 pm", "Meeting moved to Thursday\nRoom 3, 2 pm"),
    ("Speed limit 30", "Speed limit 80"),
    ("PASS", "FAIL"),
    ("Temperature 21 C", "Temperature 27 C"),
)
QUICK_TEXT_PAIRS = TEXT_PAIRS[:6]
THRESHOLDS = tuple(round(0.80 + 0.01 * i, 2) for i in range(20))  # 0.80 .. 0.99
DEFAULT_MIN_PIXELS = 4096  # the tiny checkpoint's processor budget (splitvl.tiny_model)
DEFAULT_MAX_PIXELS = 65536
MAX_DECODED_PIXELS = 40_000_000


def _skimage_dir() -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data"


def _encode(image: Image.Image, fmt: str, **kw: Any) -> bytes:
    if fmt == "PNG":
        kw.setdefault("compress_level", 1)  # lossless either way; level 6 is 5x slower
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def encode_mjpeg(image: Image.Image, qscale: int = 3) -> bytes:
    """``image`` as a JPEG from ffmpeg's own MJPEG encoder (PyAV, full-range 4:2:0 at a
    fixed ``qscale``; 3 is about Pillow's q85 in size): another DCT and quantiser than
    libjpeg's (Pillow's), as phones' hardware encoders have, so the JPEG-matched check
    does not apply to it and the coefficient-interval check does."""
    from fractions import Fraction

    import av

    codec = av.CodecContext.create("mjpeg", "w")
    codec.width, codec.height = image.size
    codec.pix_fmt = "yuvj420p"
    codec.time_base = Fraction(1, 25)
    codec.options = {"qmin": str(qscale), "qmax": str(qscale)}
    codec.open()
    frame = av.VideoFrame.from_image(image.convert("RGB")).reformat(format="yuvj420p")
    return bytes((codec.encode(frame) + codec.encode(None))[0])


def _decode(data: bytes) -> Image.Image:
    return decode_image(data, index=0, max_decoded_pixels=MAX_DECODED_PIXELS)


def _resize(image: Image.Image, scale: float) -> Image.Image:
    w, h = image.size
    return image.resize(
        (max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC
    )


def _crop(image: Image.Image, frac: float, *, centred: bool) -> Image.Image:
    w, h = image.size
    dx, dy = round(w * frac), round(h * frac)
    if centred:
        return image.crop((dx // 2, dy // 2, w - (dx - dx // 2), h - (dy - dy // 2)))
    return image.crop((dx, dy, w, h))  # all of it off the top-left: content shifts


def near_duplicate_variants(image: Image.Image, source_format: str) -> list[tuple[str, bytes]]:
    """Encoded near duplicates of one decoded image: (transform name, file bytes)."""
    out: list[tuple[str, bytes]] = []
    png = "PNG"
    for q in (70, 80, 90, 95):
        out.append((f"jpeg-q{q}", _encode(image, "JPEG", quality=q)))
    # Another encoder, and a JPEG of a JPEG (a photo re-shared through two apps).
    out.append(("ffmpeg-jpeg-q3", encode_mjpeg(image, 3)))
    first = _decode(_encode(image, "JPEG", quality=90))
    out.append(("two-jpegs-q90-q75", _encode(first, "JPEG", quality=75)))
    for scale in (0.90, 0.95, 0.98, 0.99, 1.05, 1.10):
        out.append((f"resize-{scale:.2f}", _encode(_resize(image, scale), png)))
    for frac in (0.01, 0.02, 0.03):
        out.append((f"crop-{frac:.0%}-centred", _encode(_crop(image, frac, centred=True), png)))
    out.append(("crop-3%-corner", _encode(_crop(image, 0.03, centred=False), png)))
    for factor in (0.95, 0.97, 1.03, 1.05):
        out.append(
            (
                f"brightness-{factor:.2f}",
                _encode(ImageEnhance.Brightness(image).enhance(factor), png),
            )
        )
        out.append(
            (f"contrast-{factor:.2f}", _encode(ImageEnhance.Contrast(image).enhance(factor), png))
        )
    if source_format == "JPEG":
        out.append(("jpeg->png", _encode(image, png)))
    else:
        out.append(
            ("png->jpeg-q85->png", _encode(_decode(_encode(image, "JPEG", quality=85)), png))
        )
    out.append(("resize-0.95+jpeg-q85", _encode(_resize(image, 0.95), "JPEG", quality=85)))
    out.append(("crop-2%+jpeg-q80", _encode(_crop(image, 0.02, centred=True), "JPEG", quality=80)))
    return out


FILLER = (
    "Quarterly report, page 3. Figures are in thousands unless stated otherwise.",
    "Shipments left the northern warehouse on schedule; two pallets were returned.",
    "The committee will review the budget at its next meeting in the spring.",
    "Contact the service desk for access to the archive and the older records.",
)


def render_text(text: str, layout: str) -> Image.Image:
    """Render ``text`` (Pillow ``ImageDraw``, its default FreeType font) in one layout:

    * ``label``: 64 px type on a tight canvas at least 640 px wide;
    * ``note``: 40 px type on a 640x360 card;
    * ``page``: 22 px type at the top left of an 800x600 page, the rest blank;
    * ``dense``: 16 px type, the text among 40 lines of filler on a 1600x1200 page (the
      changed glyph is well under 0.1% of the ink).
    """
    if layout == "dense":
        lines = [FILLER[i % len(FILLER)] for i in range(40)]
        lines[17] = text.replace("\n", "  ")
        text = "\n".join(lines)
    layouts: dict[str, tuple[int, tuple[int, int] | None]] = {
        "label": (64, None),
        "note": (40, (640, 360)),
        "page": (22, (800, 600)),
        "dense": (16, (1600, 1200)),
    }
    size, canvas = layouts[layout]
    font = ImageFont.load_default(size=size)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    _, _, right, bottom = probe.multiline_textbbox((0, 0), text, font=font, spacing=8)
    if canvas is None:
        canvas = (max(640, int(right) + 40), int(bottom) + 40)
    image = Image.new("RGB", canvas, (250, 250, 245))
    draw = ImageDraw.Draw(image)
    draw.multiline_text((20, 20), text, font=font, fill=(20, 20, 30), spacing=8)
    return image


TEXT_LAYOUTS = ("label", "note", "page", "dense")


# Adversarial distinct pairs (one number, word or bar apart) that are NOT document-like:
# coloured panels, gradients and sensor noise keep them away from is_document_like, so
# only the verification can tell them apart (the descriptor scores them 0.98-1.00).
RECEIPT_TOTALS = (("19.33", "79.33"), ("42.10", "42.70"), ("8.99", "6.99"))
CHART_VALUES = (
    ((200, 150, 120, 180, 90), (200, 170, 120, 180, 90)),
    ((120, 140, 160, 180, 200), (120, 140, 160, 180, 190)),
    ((90, 60, 150, 40, 110), (90, 60, 150, 40, 100)),
)
UI_MESSAGES = (
    ("Transfer $100 approved", "Transfer $100 DENIED"),
    ("PIN 4821", "PIN 9135"),
    ("Status: online", "Status: offline"),
    ("Balance 1,250.00", "Balance 7,250.00"),
)
# One character apart (a digit of an amount, a letter of a code), for the photographed
# pages and screenshots drawn at several text sizes.
ONE_CHARACTER = (
    ("Total due: 1,284.50 EUR", "Total due: 1,284.90 EUR"),
    ("Order ref QX-4471-B", "Order ref QX-4477-B"),
    ("Dose 2.5 mg at 08:00", "Dose 2.6 mg at 08:00"),
    ("Seat 14C, gate A7", "Seat 14C, gate A1"),
)
TEXT_SIZES = (12, 16, 22, 30)  # px on the 800x600 page photo
QUICK_TEXT_SIZES = (12, 22)
SCREEN_SIZES = (11, 14, 18)  # px in the 400x300 screenshot
QUICK_SCREEN_SIZES = (11,)
# The invoice photo's total, one digit apart.
INVOICE_TOTALS = (("2,413.57", "2,413.51"), ("744.11", "794.11"))
# (row, col) of the one changed cell of the spreadsheet, and its two values.
SPREADSHEET_EDITS = (((6, 3), "4,871.20", "4,871.29"), ((15, 6), "312.00", "372.00"))
# vLLM's benchmark images: i.i.d. random pixels, (width, height).
RANDOM_SIZES = ((512, 512), (1024, 768), (224, 224))
# (photo, alpha, year a, year b): a white 36 px '(c) {year} Alice Smith' watermark,
# changed in one digit. Alpha 30 over fine texture (fur, gravel) is below what the
# verification sees (benchmarks/cache-calibration.md), so those are not in the set.
WATERMARKS = (
    ("astronaut.png", 30, "2024", "2021"),
    ("coffee.png", 30, "2023", "2028"),
    ("chelsea.png", 40, "2019", "2010"),
    ("rocket.jpg", 40, "2024", "2021"),
)
# (victim, attacker's detail source): the attacker image has the victim's 32x32 box
# averages (so the same descriptor) and the other image's detail.
POISON_PAIRS = (
    ("astronaut.png", "chelsea.png"),
    ("coffee.png", "text.png"),
    ("camera.png", "gravel.png"),
    ("rocket.jpg", "brick.png"),
)
QUICK_POISON_PAIRS = POISON_PAIRS[:2]


def receipt(total: str, *, seed: int, gradient: bool = True, noise: float = 6.0) -> Image.Image:
    """A phone photo of a receipt: 22 px text on a lighting gradient with sensor noise."""
    rng = np.random.default_rng(seed)
    w, h = 384, 512
    y = np.linspace(150, 235, h)[:, None] if gradient else np.full((h, 1), 235.0)
    x = np.linspace(-25, 10, w)[None, :] if gradient else np.zeros((1, w))
    bg = (y + x + rng.normal(0, noise, (h, w))).clip(0, 255)
    image = Image.fromarray(np.stack([bg, bg * 0.97, bg * 0.9], -1).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=22)
    lines = [
        "ACME STORE #42",
        "Milk        2.49",
        "Bread       3.10",
        "Eggs        4.75",
        "Coffee      8.99",
        "",
        f"TOTAL   ${total}",
        "CARD ****1234",
    ]
    for i, line in enumerate(lines):
        draw.text((30, 40 + i * 50), line, fill=(30, 30, 30), font=font)
    return image


def text_page_photo(text: str, *, seed: int, size: int = 22) -> Image.Image:
    """A phone photo of a text page: ``size`` px text at the top left of an 800x600 page on
    a lighting gradient with sensor noise (not document-like). At the tiny checkpoint's
    pixel budget 22 px glyphs shrink to ~8 px, where one changed digit is within resampling
    noise at the plan's resolution; the verification image keeps the decoded 800x600."""
    rng = np.random.default_rng(seed)
    w, h = 800, 600
    bg = np.linspace(150, 235, h)[:, None] + np.linspace(-25, 10, w)[None, :]
    bg = (bg + rng.normal(0, 6, (h, w))).clip(0, 255)
    image = Image.fromarray(np.stack([bg, bg * 0.97, bg * 0.9], -1).astype(np.uint8))
    ImageDraw.Draw(image).multiline_text(
        (20, 20), text, font=ImageFont.load_default(size=size), fill=(30, 30, 30), spacing=8
    )
    return image


def invoice_photo(total: str, *, seed: int, size: tuple[int, int] = (1200, 1600)) -> Image.Image:
    """A phone photo of an invoice page (a lighting gradient, sensor noise, a slight warm
    tint): a header, six line items and ``TOTAL EUR {total}`` in 28 px type on a page of
    ``size`` (width, height) pixels."""
    rng = np.random.default_rng(seed)
    w, h = size
    bg = np.linspace(160, 238, h)[:, None] + np.linspace(-20, 12, w)[None, :]
    bg = (bg + rng.normal(0, 5, (h, w))).clip(0, 255)
    image = Image.fromarray(np.stack([bg, bg * 0.98, bg * 0.93], -1).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=28 * w // 1200)
    lines = [
        "INVOICE 2026-0417",
        "Northwind Supplies GmbH",
        "",
        "Paper A4, 10 boxes        182.40",
        "Toner cartridges x4       316.00",
        "Desk lamps x2              89.90",
        "Cable ties, 500           12.35",
        "Shipping                   24.00",
        "VAT 19%                   119.46",
        "",
        f"TOTAL EUR {total}",
    ]
    step = 48 * w // 1200
    for i, line in enumerate(lines):
        draw.text((60 * w // 1200, 80 * w // 1200 + i * step), line, fill=(25, 25, 35), font=font)
    return image


def spreadsheet(cells: dict[tuple[int, int], str], *, banded: bool = False) -> Image.Image:
    """A 960x540 spreadsheet screenshot: a toolbar, a header row, 20 rows x 8 columns of
    14 px numbers (filled from a fixed seed), gridlines; ``cells`` overrides (row, col).
    ``banded``: rows alternate white and light blue (then it is not document-like, so the
    similarity tier and its verification see it)."""
    rng = np.random.default_rng(7)
    image = Image.new("RGB", (960, 540), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 960, 44), fill=(33, 115, 70))
    draw.rectangle((0, 44, 960, 68), fill=(242, 242, 242))
    font = ImageFont.load_default(size=14)
    col_w, row_h, top = 116, 22, 68
    for c in range(8):
        draw.text((40 + c * col_w + 6, 48), chr(65 + c), fill=(60, 60, 60), font=font)
    for r in range(21):
        y = top + r * row_h
        if banded and r % 2:
            draw.rectangle((0, y, 960, y + row_h), fill=(205, 222, 245))
        draw.line((0, y, 960, y), fill=(210, 210, 210))
        draw.text((8, y + 4), str(r + 1), fill=(90, 90, 90), font=font)
        for c in range(8):
            value = cells.get((r, c), f"{rng.integers(100, 99999) / 100:,.2f}")
            draw.text((40 + c * col_w + 6, y + 4), value, fill=(20, 20, 20), font=font)
    for c in range(9):
        draw.line((40 + c * col_w, 44, 40 + c * col_w, 540), fill=(210, 210, 210))
    return image


def random_pixels(width: int, height: int, *, seed: int) -> Image.Image:
    """i.i.d. uniform random RGB pixels, as vLLM's multimodal benchmark generates (its
    ``random-mm`` dataset draws ``np.random.randint(0, 256, (h, w, 3))``)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def bar_chart(values: tuple[int, ...]) -> Image.Image:
    """A 320x256 bar chart with coloured bars and a small caption."""
    image = Image.new("RGB", (320, 256), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    for i, v in enumerate(values):
        draw.rectangle((20 + i * 60, 240 - v, 60 + i * 60, 240), fill=colors[i])
    draw.text((10, 5), "Q values", fill=(0, 0, 0))
    return image


def ui_screen(message: str, *, dark: bool, size: int = 18) -> Image.Image:
    """A 400x300 app screenshot: title bar, side panel, a card with one line of ``size`` px
    text."""
    image = Image.new("RGB", (400, 300), (40, 44, 52) if dark else (245, 245, 245))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 400, 40), fill=(66, 133, 244))
    draw.rectangle((0, 40, 90, 300), fill=(30, 33, 40) if dark else (220, 220, 225))
    draw.rectangle((110, 60, 380, 280), fill=(50, 55, 65) if dark else (255, 255, 255))
    draw.text(
        (120, 80),
        message,
        fill=(230, 230, 230) if dark else (0, 0, 0),
        font=ImageFont.load_default(size=size),
    )
    return image


def watermark(photo: Image.Image, year: str, alpha: int) -> Image.Image:
    """``photo`` with a white 36 px '(c) {year} Alice Smith' at ``alpha`` (of 255) near
    its bottom left: a photographer's credit, a date stamp."""
    layer = Image.new("RGBA", photo.size, (0, 0, 0, 0))
    font = ImageFont.load_default(size=36)
    xy = (40, photo.size[1] - 72)
    text = f"(c) {year} Alice Smith"
    ImageDraw.Draw(layer).text(xy, text, fill=(255, 255, 255, alpha), font=font)
    return Image.alpha_composite(photo.convert("RGBA"), layer).convert("RGB")


def lowfreq_swap(target: Image.Image, detail: Image.Image, side: int = 256) -> Image.Image:
    """The poisoning construction: an image whose 32x32 box averages are ``target``'s and
    whose detail (everything inside each cell minus the cell mean) is ``detail``'s."""
    t = np.asarray(target.convert("RGB").resize((side, side)), dtype=np.float32)
    d = np.asarray(detail.convert("RGB").resize((side, side)), dtype=np.float32)
    c = side // DESCRIPTOR_CELLS

    def cells(a: np.ndarray) -> np.ndarray:
        means = a.reshape(DESCRIPTOR_CELLS, c, DESCRIPTOR_CELLS, c, 3).mean(axis=(1, 3))
        return np.repeat(np.repeat(means, c, 0), c, 1)

    out = d - cells(d) + cells(t)
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8))


def adversarial_pairs(quick: bool = False) -> list[tuple[str, Image.Image, Image.Image]]:
    """(kind, a, b): distinct pairs built to fool a thumbnail descriptor."""
    out: list[tuple[str, Image.Image, Image.Image]] = []
    for i, (ta, tb) in enumerate(RECEIPT_TOTALS[:1] if quick else RECEIPT_TOTALS):
        out.append(("receipt-gradient", receipt(ta, seed=i), receipt(tb, seed=i)))
        if not quick:
            # Fresh sensor noise on the second shot: the same receipt photographed twice.
            out.append(("receipt-new-noise", receipt(ta, seed=i), receipt(tb, seed=100 + i)))
    for va, vb in CHART_VALUES[:1] if quick else CHART_VALUES:
        out.append(("chart-one-bar", bar_chart(va), bar_chart(vb)))
    for ma, mb in UI_MESSAGES[:2] if quick else UI_MESSAGES:
        out.append(("ui-light", ui_screen(ma, dark=False), ui_screen(mb, dark=False)))
        out.append(("ui-dark", ui_screen(ma, dark=True), ui_screen(mb, dark=True)))
    for i, (ta, tb) in enumerate(TEXT_PAIRS[:1] if quick else TEXT_PAIRS[:4]):
        out.append(("text-page-photo", text_page_photo(ta, seed=i), text_page_photo(tb, seed=i)))
    # One character changed, at several text sizes: photographed pages and screenshots.
    for size in QUICK_TEXT_SIZES if quick else TEXT_SIZES:
        ta, tb = ONE_CHARACTER[size % len(ONE_CHARACTER)]
        out.append(
            (
                f"page-photo-{size}px",
                text_page_photo(ta, seed=size, size=size),
                text_page_photo(tb, seed=size, size=size),
            )
        )
    for size in QUICK_SCREEN_SIZES if quick else SCREEN_SIZES:
        ma, mb = ONE_CHARACTER[size % len(ONE_CHARACTER)]
        for dark in (False, True):
            out.append(
                (
                    f"screen-{'dark' if dark else 'light'}-{size}px",
                    ui_screen(ma.split("\n")[0], dark=dark, size=size),
                    ui_screen(mb.split("\n")[0], dark=dark, size=size),
                )
            )
    for i, (ta, tb) in enumerate(INVOICE_TOTALS[:1] if quick else INVOICE_TOTALS):
        out.append(("invoice-photo", invoice_photo(ta, seed=i), invoice_photo(tb, seed=i)))
    for cell, old, new in SPREADSHEET_EDITS[:1] if quick else SPREADSHEET_EDITS:
        out.append(("spreadsheet-one-cell", spreadsheet({cell: old}), spreadsheet({cell: new})))
        banded = spreadsheet({cell: old}, banded=True), spreadsheet({cell: new}, banded=True)
        out.append(("spreadsheet-banded-one-cell", *banded))
    for i, (w, h) in enumerate(RANDOM_SIZES[:1] if quick else RANDOM_SIZES):
        a, b = random_pixels(w, h, seed=2 * i), random_pixels(w, h, seed=2 * i + 1)
        out.append(("random-pixels", a, b))
    root = _skimage_dir()
    for name, alpha, year_a, year_b in WATERMARKS[:1] if quick else WATERMARKS:
        photo = _decode((root / name).read_bytes())
        a, b = watermark(photo, year_a, alpha), watermark(photo, year_b, alpha)
        out.append(("watermark-one-digit", a, b))
    for victim, source in QUICK_POISON_PAIRS if quick else POISON_PAIRS:
        v = _decode((root / victim).read_bytes()).resize((256, 256))
        s = _decode((root / source).read_bytes())
        out.append(("poison-32x32-average", lowfreq_swap(v, s), v))
    return out


@dataclass
class Item:
    """One image as the gateway sees it: its descriptor, its grid, the grids a similarity
    hit may serve for it (:func:`vlcommon.grid_reuse.reusable_grids`), its verification
    image and their costs."""

    name: str
    descriptor: np.ndarray
    grid: tuple[int, int, int]
    descriptor_ms: float
    verification: VerificationImage | None = None  # vlcommon.verification; None: exact only
    verification_ms: float = 0.0
    reusable: tuple[tuple[int, int, int], ...] = ()

    @property
    def zero(self) -> bool:
        """No descriptor (document-like or flat): the image can only hit exactly."""
        return not bool(np.any(self.descriptor))


@dataclass
class Pair:
    """Two images; ``a`` is the one stored first, ``b`` the query (for near duplicates the
    original and its copy)."""

    kind: str  # "near" or "distinct"
    a: Item
    b: Item
    transform: str
    cosine: float = field(init=False)
    residual: float = field(init=False)

    def __post_init__(self) -> None:
        self.cosine = cosine_similarity(self.a.descriptor, self.b.descriptor)
        self.residual = verification_residual(self.a.verification, self.b.verification)

    @property
    def verified(self) -> bool:
        """The cache's verification (:func:`vlcommon.verification.verify`) passes."""
        return self.residual <= VERIFY_TOLERANCE

    @property
    def grid_ok(self) -> bool:
        """The stored grid may serve the query: equal, or in the query's aspect class. For
        a distinct pair either image may be the one stored, so either direction counts."""
        forward = self.a.grid in self.b.reusable or self.a.grid == self.b.grid
        if self.kind == "near":
            return forward
        return forward or self.b.grid in self.a.reusable

    def hit(self, threshold: float) -> bool:
        """What the cache serves: cosine >= threshold, a stored grid the query may be
        served with, and the verification passes."""
        return self.cosine >= threshold and self.grid_ok and self.verified

    @property
    def same_grid(self) -> bool:
        return self.a.grid == self.b.grid

    @property
    def crop(self) -> bool:
        return "crop" in self.transform


def default_spec(
    min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS
) -> VisionSpec:
    """Qwen3-VL geometry (patch 16, merge 2) with the given pixel budget; the widths do not
    matter here."""
    return VisionSpec(
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        out_hidden_size=1,
        n_deepstack=0,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    )


Describe = Callable[[Image.Image], np.ndarray]


def _item(name: str, data: bytes, spec: VisionSpec, describe: Describe, grid_bound: float) -> Item:
    image = _decode(data)
    plan = plan_resize(image.height, image.width, spec, index=0)
    reusable = reusable_grids(
        image.height,
        image.width,
        spec,
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        bound=grid_bound,
    )
    # CPU time of this thread: the machine is shared, wall time would measure the others.
    start = time.thread_time()
    descriptor = describe(image)
    ms = (time.thread_time() - start) * 1000
    # The gateway builds the verification image from the decoded image, not the plan,
    # and none when the plan holds more pixels than it (an exact hit only).
    start = time.thread_time()
    plan_pixels = plan.resized_height * plan.resized_width
    verification = (
        verification_image(image, data)
        if verifiable(image.width, image.height, plan_pixels)
        else None
    )
    verify_ms = (time.thread_time() - start) * 1000
    return Item(
        name=name,
        descriptor=descriptor,
        grid=plan.grid,
        descriptor_ms=ms,
        verification=verification,
        verification_ms=verify_ms,
        reusable=tuple(reusable),
    )


def build_pairs(
    spec: VisionSpec,
    *,
    quick: bool = False,
    describe: Describe = similarity_descriptor,
    grid_bound: float = DEFAULT_GRID_REUSE_SCALE,
) -> list[Pair]:
    """All labelled pairs, each image decoded (from encoded bytes) and described once.

    Near duplicates: each photo against its :func:`near_duplicate_variants`. Distinct:
    all pairs of photos; for each text pair and layout the two renders (PNG) and the
    first render against a JPEG (quality 80) of the second; for each adversarial pair the
    two (PNG), and the first against a JPEG of the second by Pillow (quality 90) and by
    ffmpeg (:func:`encode_mjpeg`).
    """
    root = _skimage_dir()
    photos = QUICK_PHOTOS if quick else PHOTOS
    originals: list[Item] = []
    pairs: list[Pair] = []
    for name in photos:
        data = (root / name).read_bytes()
        item = _item(name, data, spec, describe, grid_bound)
        originals.append(item)
        fmt = "JPEG" if name.endswith(".jpg") else "PNG"
        for transform, variant in near_duplicate_variants(_decode(data), fmt):
            other = _item(f"{name}:{transform}", variant, spec, describe, grid_bound)
            pairs.append(Pair("near", item, other, transform))
    for a, b in itertools.combinations(originals, 2):
        pairs.append(Pair("distinct", a, b, "other photo"))
    for i, (ta, tb) in enumerate(QUICK_TEXT_PAIRS if quick else TEXT_PAIRS):
        for layout in TEXT_LAYOUTS:
            ia, ib = render_text(ta, layout), render_text(tb, layout)
            a = _item(f"text{i}-{layout}-a", _encode(ia, "PNG"), spec, describe, grid_bound)
            b = _item(f"text{i}-{layout}-b", _encode(ib, "PNG"), spec, describe, grid_bound)
            b_jpeg = _item(
                f"text{i}-{layout}-b:jpeg-q80",
                _encode(ib, "JPEG", quality=80),
                spec,
                describe,
                grid_bound,
            )
            pairs.append(Pair("distinct", a, b, f"text-{layout}"))
            pairs.append(Pair("distinct", a, b_jpeg, f"text-{layout}-vs-jpeg"))
    for i, (kind, ia, ib) in enumerate(adversarial_pairs(quick)):
        a = _item(f"adv{i}-{kind}-a", _encode(ia, "PNG"), spec, describe, grid_bound)
        b = _item(f"adv{i}-{kind}-b", _encode(ib, "PNG"), spec, describe, grid_bound)
        b_jpeg = _item(
            f"adv{i}-{kind}-b:jpeg-q90", _encode(ib, "JPEG", quality=90), spec, describe, grid_bound
        )
        b_mjpeg = _item(
            f"adv{i}-{kind}-b:ffmpeg-jpeg-q3", encode_mjpeg(ib), spec, describe, grid_bound
        )
        pairs.append(Pair("distinct", a, b, f"adversarial-{kind}"))
        pairs.append(Pair("distinct", a, b_jpeg, f"adversarial-{kind}-vs-jpeg"))
        pairs.append(Pair("distinct", a, b_mjpeg, f"adversarial-{kind}-vs-ffmpeg-jpeg"))
    return pairs


def descriptor_cost(repeats: int = 20) -> dict[str, float]:
    """Median CPU ms of :func:`similarity_descriptor` on astronaut at 448x448 and 2000x2000."""
    image = _decode((_skimage_dir() / "astronaut.png").read_bytes())
    out = {}
    for side in (448, 2000):
        sized = image.resize((side, side), Image.Resampling.BICUBIC)
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            similarity_descriptor(sized)
            times.append((time.thread_time() - start) * 1000)
        out[f"{side}x{side}"] = round(float(np.median(times)), 2)
    return out


def verification_cost(repeats: int = 10) -> dict[str, dict[str, float]]:
    """Median CPU ms of :func:`verification_image` (gateway; ``jpeg_image_ms``: of a JPEG
    with its file, the JPEG's luma decoded again) and :func:`verification_residual`
    (cache, per candidate, both directions and the JPEG-matched check computed: the worst
    case) against a JPEG of the same size and against a 5% smaller copy (the resampling
    path), for decoded images of 448x448, 1024x1024, 2048x2048 and 4032x3024 (12 MP, over
    the cap), and the verification image's bytes (what one entry stores; ``jpeg_bytes``:
    the JPEG's, with its table and, where the conversion to RGB clipped, its own luma)."""
    image = _decode((_skimage_dir() / "astronaut.png").read_bytes())
    out = {}
    for w, h in ((448, 448), (1024, 1024), (2048, 2048), (4032, 3024)):
        sized = image.resize((w, h), Image.Resampling.BICUBIC)
        jpeg_bytes = _encode(sized, "JPEG", quality=90)
        jpeg = _decode(jpeg_bytes)
        smaller = _resize(sized, 0.95)
        make, make_jpeg, same, resampled = [], [], [], []
        for _ in range(repeats):
            start = time.thread_time()
            a = verification_image(sized)
            make.append((time.thread_time() - start) * 1000)
            start = time.thread_time()
            b = verification_image(jpeg, jpeg_bytes)
            make_jpeg.append((time.thread_time() - start) * 1000)
            c = verification_image(smaller)
            start = time.thread_time()
            verification_residual(a, b)
            same.append((time.thread_time() - start) * 1000)
            start = time.thread_time()
            verification_residual(a, c)
            resampled.append((time.thread_time() - start) * 1000)
        out[f"{w}x{h}"] = {
            "image_ms": round(float(np.median(make)), 3),
            "jpeg_image_ms": round(float(np.median(make_jpeg)), 3),
            "residual_ms": round(float(np.median(same)), 3),
            "residual_resampled_ms": round(float(np.median(resampled)), 3),
            "bytes": int(a.nbytes),
            "jpeg_bytes": int(b.nbytes),
        }
    return out


def coefficient_cost(repeats: int = 7) -> dict[str, dict[str, float]]:
    """Median thread CPU ms of :func:`jpeg_matched_score` (the cache, per candidate that
    passed the six checks) between a decoded image and an ffmpeg MJPEG
    (:func:`encode_mjpeg`, qscale 3) of it, where the JPEG-matched check does not apply
    and the coefficient-interval check runs, at the sizes where a JPEG keeps its
    verification image whole: 448x448, 1024x1024 and 1448x1448 (2 MP). ``one_pass_ms``:
    a copy, which passes on the first pass; ``search_ms``: the same with a 32x32 patch
    inverted before the JPEG (an edit), which fails and runs the first-generation search
    over all of ``COEF_FIRST_GENERATIONS``; ``copy_score`` and ``edit_score`` are the
    scores timed (``VERIFY_TOLERANCE`` units, 0 where no check applies)."""
    image = _decode((_skimage_dir() / "astronaut.png").read_bytes())
    out = {}
    for side in (448, 1024, 1448):
        sized = image.resize((side, side), Image.Resampling.BICUBIC)
        pixels = np.array(sized)
        middle = slice(side // 2 - 16, side // 2 + 16)
        pixels[middle, middle] = 255 - pixels[middle, middle]
        original = verification_image(sized)
        sides = []
        for picture in (sized, Image.fromarray(pixels)):
            data = encode_mjpeg(picture)
            sides.append(verification_image(_decode(data), data))
        scores: list[float] = []
        times: list[float] = []
        for copy in sides:
            spent = []
            for _ in range(repeats):
                start = time.thread_time()
                score = jpeg_matched_score(original, copy)
                spent.append((time.thread_time() - start) * 1000)
            scores.append(round(score, 3))
            times.append(round(float(np.median(spent)), 2))
        out[f"{side}x{side}"] = {
            "one_pass_ms": times[0],
            "search_ms": times[1],
            "copy_score": scores[0],
            "edit_score": scores[1],
        }
    return out


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 1.0


def _row(pairs: list[Pair], threshold: float) -> dict[str, Any]:
    near = [p for p in pairs if p.kind == "near"]
    distinct = [p for p in pairs if p.kind == "distinct"]
    hits = [p.hit(threshold) for p in near]
    false_hits = sum(p.hit(threshold) for p in distinct)
    tp = sum(hits)
    return {
        "threshold": threshold,
        "false_hits": false_hits,
        "false_hits_descriptor_only": sum(p.cosine >= threshold for p in distinct),
        "precision": tp / (tp + false_hits) if tp + false_hits else 1.0,
        "descriptor_recall": _share([p.cosine >= threshold for p in near]),
        "near_duplicate_recall": _share(hits),
        "recall_without_crops": _share([h for h, p in zip(hits, near, strict=True) if not p.crop]),
        "crop_recall": _share([h for h, p in zip(hits, near, strict=True) if p.crop]),
        "grid_changed_hits": sum(h and not p.same_grid for h, p in zip(hits, near, strict=True)),
    }


def evaluate(
    pairs: list[Pair], threshold: float, thresholds: Iterable[float] = THRESHOLDS
) -> dict[str, Any]:
    """The report for ``threshold`` plus the table over ``thresholds``.

    Returns:
        ``threshold``; ``false_hits`` (distinct pairs the cache would serve: cosine >=
        threshold, a grid the query may be served with in either direction, a passing
        verification) out of ``distinct_pairs``; ``near_duplicate_recall`` (all near
        duplicates the cache would serve, the copy looked up against the stored original),
        ``recall_without_crops`` and ``crop_recall`` (crops reported apart: a crop removes
        content) over ``near_duplicate_pairs``; ``grid_changed_hits`` (hits served with the
        stored, other grid); ``descriptor_recall`` (cosine alone); ``document_like``; the
        lowest near-duplicate and highest distinct cosines and residuals; costs;
        ``by_transform``, ``by_distinct_kind``; ``table``, one row per threshold.
    """
    near = [p for p in pairs if p.kind == "near"]
    distinct = [p for p in pairs if p.kind == "distinct"]
    items = {p.a.name: p.a for p in pairs} | {p.b.name: p.b for p in pairs}
    texts = [i for n, i in items.items() if n.startswith("text") and "-" in n.split(":")[0]]
    adversarial = [i for n, i in items.items() if n.startswith("adv")]
    photos = [i for i in items.values() if i not in texts and i not in adversarial]
    row = _row(pairs, threshold)
    ms = np.array([i.descriptor_ms for i in items.values()])
    return {
        "threshold": threshold,
        "false_hits": row["false_hits"],
        "distinct_pairs": len(distinct),
        "near_duplicate_recall": row["near_duplicate_recall"],
        "recall_without_crops": row["recall_without_crops"],
        "crop_recall": row["crop_recall"],
        "near_duplicate_pairs": len(near),
        "crop_pairs": sum(p.crop for p in near),
        "grid_changed_hits": row["grid_changed_hits"],
        "near_duplicates_same_grid": sum(p.same_grid for p in near),
        "near_duplicates_reusable_grid": sum(p.grid_ok for p in near),
        "descriptor_recall": row["descriptor_recall"],
        "document_like": {
            "photos": sorted(i.name for i in photos if i.zero),
            "text_images": sum(i.zero for i in texts),
            "text_images_total": len(texts),
            "adversarial_images": sum(i.zero for i in adversarial),
            "adversarial_images_total": len(adversarial),
        },
        "false_hits_descriptor_only": row["false_hits_descriptor_only"],
        "false_hit_pairs": [
            [f"{p.a.name} ~ {p.b.name}", round(p.cosine, 4), round(p.residual, 2)]
            for p in distinct
            if p.hit(threshold)
        ],
        "lowest_near_duplicates": [
            [p.b.name, round(p.cosine, 4)] for p in sorted(near, key=lambda p: p.cosine)[:5]
        ],
        "highest_distinct": [
            [f"{p.a.name} ~ {p.b.name}", round(p.cosine, 4)]
            for p in sorted(distinct, key=lambda p: -p.cosine)[:5]
        ],
        "highest_distinct_photos": [
            [f"{p.a.name} ~ {p.b.name}", round(p.cosine, 4)]
            for p in sorted(
                (p for p in distinct if p.transform == "other photo"), key=lambda p: -p.cosine
            )[:5]
        ],
        "descriptor_ms": {
            "mean": round(float(ms.mean()), 2),
            "p50": round(float(np.median(ms)), 2),
            "max": round(float(ms.max()), 2),
        },
        "verification_ms": {
            "p50": round(float(np.median([i.verification_ms for i in items.values()])), 3),
            "max": round(float(max(i.verification_ms for i in items.values())), 3),
        },
        # The distinct pairs the verification has to refuse (cosine over the threshold and
        # a servable grid), closest first; then the near duplicates it accepts, largest first.
        "lowest_distinct_residuals": [
            [f"{p.a.name} ~ {p.b.name}", round(p.residual, 2)]
            for p in sorted(
                (p for p in distinct if p.cosine >= threshold and p.grid_ok),
                key=lambda p: p.residual,
            )[:8]
        ],
        "highest_near_duplicate_residuals_kept": [
            [p.b.name, round(p.residual, 2)]
            for p in sorted(
                (p for p in near if p.verified and not p.crop), key=lambda p: -p.residual
            )[:5]
        ],
        "near_duplicates_refused": [
            [p.b.name, round(p.cosine, 4), round(p.residual, 2), p.grid_ok]
            for p in near
            if not p.crop and not p.hit(threshold)
        ],
        "verify_tolerance": VERIFY_TOLERANCE,
        "by_transform": _by_transform(near, threshold),
        "by_distinct_kind": _by_distinct_kind(distinct, threshold),
        "table": [_row(pairs, t) for t in thresholds],
    }


def _family(transform: str) -> str:
    """``resize-0.95`` -> ``resize-0.95``; ``jpeg-q80`` -> ``jpeg``; ``crop-2%-centred`` ->
    ``crop-centred``: JPEG qualities and crop sizes pooled, resize scales kept apart (the
    grid rule depends on the scale)."""
    if transform.startswith("jpeg-q"):
        return "jpeg"
    if transform.startswith("crop-") and "+" not in transform:
        return "crop-" + transform.rsplit("-", 1)[1]
    if transform.startswith(("brightness", "contrast")):
        return transform.split("-", 1)[0]
    return transform


def _by_transform(near: list[Pair], threshold: float) -> dict[str, dict[str, float]]:
    """Near duplicates grouped by transform: pairs, descriptor recall, hit recall, grid
    changes among the hits."""
    groups: dict[str, list[Pair]] = {}
    for p in near:
        groups.setdefault(_family(p.transform), []).append(p)
    return {
        name: {
            "pairs": len(ps),
            "descriptor_recall": round(sum(p.cosine >= threshold for p in ps) / len(ps), 4),
            "hit_recall": round(sum(p.hit(threshold) for p in ps) / len(ps), 4),
            "grid_changed_hits": sum(p.hit(threshold) and not p.same_grid for p in ps),
        }
        for name, ps in groups.items()
    }


def _by_distinct_kind(distinct: list[Pair], threshold: float) -> dict[str, dict[str, Any]]:
    """Distinct pairs grouped by kind: pairs, over the threshold, false hits, the lowest
    residual among those over the threshold (None when none is)."""
    groups: dict[str, list[Pair]] = {}
    for p in distinct:
        kind = p.transform.removesuffix("-vs-jpeg").removesuffix("-vs-ffmpeg-jpeg")
        groups.setdefault(kind, []).append(p)
    out: dict[str, dict[str, Any]] = {}
    for name, ps in groups.items():
        over = [p for p in ps if p.cosine >= threshold and p.grid_ok]
        out[name] = {
            "pairs": len(ps),
            "over_threshold": len(over),
            "false_hits": sum(p.hit(threshold) for p in ps),
            "lowest_residual": round(min(p.residual for p in over), 2) if over else None,
        }
    return out


def _default_threshold() -> float:
    from cache_service.settings import CacheSettings

    return float(CacheSettings.model_fields["threshold"].default)


def format_table(report: dict[str, Any]) -> str:
    """The table as Markdown (what benchmarks/cache-calibration.md shows)."""
    lines = [
        "| threshold | false hits | false hits, descriptor alone | precision "
        "| descriptor recall | near-duplicate recall | recall without crops | crop recall "
        "| hits with the stored grid |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["table"]:
        mark = " (default)" if abs(r["threshold"] - report["threshold"]) < 1e-9 else ""
        lines.append(
            f"| {r['threshold']:.2f}{mark} | {r['false_hits']} "
            f"| {r['false_hits_descriptor_only']} "
            f"| {r['precision']:.4f} | {r['descriptor_recall']:.4f} "
            f"| {r['near_duplicate_recall']:.4f} | {r['recall_without_crops']:.4f} "
            f"| {r['crop_recall']:.4f} | {r['grid_changed_hits']} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.model:
        from vlcommon.model_info import load_vision_spec, resolve_model_dir

        spec = load_vision_spec(resolve_model_dir(args.model))
    else:
        spec = default_spec(args.min_pixels, args.max_pixels)
    threshold = args.threshold if args.threshold is not None else _default_threshold()
    start = time.perf_counter()
    pairs = build_pairs(spec, quick=args.quick, grid_bound=args.grid_reuse_scale)
    report = evaluate(pairs, threshold)
    report["descriptor_ms_by_size"] = descriptor_cost(5 if args.quick else 20)
    report["verification_cost_by_size"] = verification_cost(3 if args.quick else 10)
    report["coefficient_cost_by_size"] = coefficient_cost(3 if args.quick else 7)
    report["pixel_budget"] = [spec.min_pixels, spec.max_pixels]
    report["grid_reuse_scale"] = args.grid_reuse_scale
    report["seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{report['near_duplicate_pairs']} near-duplicate pairs ({report['crop_pairs']} crops; "
        f"{report['near_duplicates_same_grid']} with an equal grid and "
        f"{report['near_duplicates_reusable_grid']} with a servable one at pixel budget "
        f"{spec.min_pixels}-{spec.max_pixels}), {report['distinct_pairs']} distinct pairs, "
        f"{report['seconds']} s"
    )
    print(format_table(report))
    print(
        f"at {threshold:.2f}: {report['false_hits']} false hits of {report['distinct_pairs']}, "
        f"near-duplicate recall {report['near_duplicate_recall']:.4f}, "
        f"without crops {report['recall_without_crops']:.4f}, "
        f"crops {report['crop_recall']:.4f}, "
        f"{report['grid_changed_hits']} hits served with the stored grid"
    )
    print("by transform (pairs, descriptor recall, hit recall, hits with the stored grid):")
    for name, g in report["by_transform"].items():
        print(
            f"  {name:24s} {g['pairs']:4d}  {g['descriptor_recall']:.4f}  "
            f"{g['hit_recall']:.4f}  {g['grid_changed_hits']}"
        )
    print("distinct kinds (pairs, over threshold, servable grid; false hits; lowest residual):")
    for name, g in report["by_distinct_kind"].items():
        print(
            f"  {name:32s} {g['pairs']:4d}  {g['over_threshold']:4d}  {g['false_hits']}  "
            f"{g['lowest_residual']}"
        )
    print("document-like (zero descriptor):", report["document_like"])
    print("lowest near duplicates:", report["lowest_near_duplicates"])
    print("highest distinct pairs:", report["highest_distinct"])
    print("descriptor ms:", report["descriptor_ms"], report["descriptor_ms_by_size"])
    print("verification ms:", report["verification_ms"], "tolerance", VERIFY_TOLERANCE)
    print("verification cost by decoded size:", report["verification_cost_by_size"])
    print("coefficient-interval check cost:", report["coefficient_cost_by_size"])
    print("lowest distinct residuals:", report["lowest_distinct_residuals"])
    print("false hits:", report["false_hit_pairs"])
    print("highest near-duplicate residuals kept:", report["highest_near_duplicate_residuals_kept"])
    print("near duplicates refused (not crops):", report["near_duplicates_refused"])
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache-eval", help="calibrate the similarity threshold on labelled pairs")
    p.add_argument(
        "--threshold", type=cosine, default=None, help="default: the cache service's default"
    )
    p.add_argument("--model", help="read the pixel budget from this checkpoint instead")
    p.add_argument("--min-pixels", type=positive_int, default=DEFAULT_MIN_PIXELS)
    p.add_argument("--max-pixels", type=positive_int, default=DEFAULT_MAX_PIXELS)
    p.add_argument(
        "--grid-reuse-scale",
        type=float,
        default=DEFAULT_GRID_REUSE_SCALE,
        help="the grid-change bound (relative resize per side; 0: equal grids only)",
    )
    p.add_argument("--quick", action="store_true", help="9 photos and 6 text pairs only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)
