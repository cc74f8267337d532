"""Benchmark workloads over real photos, with designed repeats and nothing else repeated.

Every image is unique unless it is a designed repeat: vLLM and splitvl both hash image
content, so a workload that cycled a few photos would let both skip work it meant them
to do. Unique images are random crops (35-100% of the short side, any position, optional
mirror, per-channel gain 0.8-1.2) of scikit-image's bundled photos, resized to the chosen
side; each new one is checked against every image made so far (same similarity
descriptor the cache uses) and redrawn while its cosine similarity is >= 0.75, so no two
"unique" images could be a similarity hit of each other either. A designed repeat is
either an exact copy of an earlier image's bytes or a near duplicate (the same pixels
re-encoded as JPEG quality 90), half each, with a different prompt.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from vlcommon.imaging import similarity_descriptor

PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "hubble_deep_field.jpg",
    "motorcycle_left.png",
    "retina.jpg",
    "ihc.png",
    "color.png",
    "camera.png",
    "page.png",
    "brick.png",
    "grass.png",
    "gravel.png",
    "moon.png",
    "coins.png",
)
PROMPTS = (
    "Describe this image.",
    "What is in this picture?",
    "List the objects you see.",
    "What colors dominate this photo?",
    "Write a caption for this image.",
    "Is there a person in this image?",
    "Describe the background.",
    "What could this picture be used for?",
)
MAX_UNIQUE_SIMILARITY = 0.75


@dataclass
class Request:
    """One request of a workload: encoded images, prompt, and what each image is."""

    images: list[bytes]
    prompt: str
    kinds: list[str]  # "unique", "exact" or "near" per image
    # Per image, the identity of what it shows: a unique image's number in its workload,
    # a repeat's original's (with a pool: its position in the pool, negative: -1 - k).
    sources: list[int] = field(default_factory=list)


@dataclass
class ImageFactory:
    """Makes pairwise-dissimilar images from the bundled photos (see the module docstring)."""

    side: int
    seed: int
    _rng: random.Random = field(init=False)
    _photos: list[Image.Image] = field(init=False)
    _descriptors: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        import skimage

        root = Path(skimage.__file__).parent / "data"
        self._rng = random.Random(self.seed)
        self._photos = [Image.open(root / name).convert("RGB") for name in PHOTOS]

    def make(self) -> Image.Image:
        for _ in range(200):
            photo = self._rng.choice(self._photos)
            short = min(photo.size)
            crop = int(short * self._rng.uniform(0.35, 1.0))
            x = self._rng.randint(0, photo.width - crop)
            y = self._rng.randint(0, photo.height - crop)
            image = photo.crop((x, y, x + crop, y + crop)).resize(
                (self.side, self.side), Image.Resampling.BILINEAR
            )
            if self._rng.random() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            gains = np.array([self._rng.uniform(0.8, 1.2) for _ in range(3)], dtype=np.float32)
            arr = np.clip(np.asarray(image, dtype=np.float32) * gains, 0, 255).astype(np.uint8)
            image = Image.fromarray(arr)
            d = similarity_descriptor(image)
            if not d.any():
                continue
            if self._descriptors and max(float(d @ e) for e in self._descriptors) >= (
                MAX_UNIQUE_SIMILARITY
            ):
                continue
            self._descriptors.append(d)
            return image
        raise RuntimeError("could not draw a dissimilar image; lower the image count")


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def make_workload(
    factory: ImageFactory,
    *,
    requests: int,
    repeat_fraction: float,
    images_per_request: int = 1,
    seed: int,
    pool: list[Image.Image] | None = None,
) -> list[Request]:
    """A list of requests in which a fixed fraction of the images are designed repeats.

    Args:
        factory: Source of unique images (shared across workloads so all stay distinct).
        requests: Number of requests.
        repeat_fraction: Fraction of the images that repeat an earlier one: exactly
            round(repeat_fraction * requests * images_per_request) of them, at random
            positions, half exact copies and half JPEG re-encodes.
        images_per_request: Images in each request.
        seed: Seed for the repeat decisions and prompts.
        pool: Images served before this workload (a warm-up set); when given, every
            repeat draws from it alone; without it, repeats draw from this workload's
            earlier images.
    """
    rng = random.Random(seed)
    seen: list[Image.Image] = []  # this workload's unique images
    # With a pool, repeats come from it only: images served before the measured run, so
    # every repeat could hit a cache (a repeat of an image still in flight cannot, and at
    # 32 concurrent requests the whole run is in flight).
    sources = list(pool) if pool else seen
    total = requests * images_per_request
    # Exactly round(fraction * total) repeats at random positions, half exact and half near
    # (a Bernoulli draw per image made a 4-request run anything from 0 to 4 repeats, and
    # the measured hit rate with it). Without a pool, the first image cannot repeat.
    slots = range(total) if pool else range(1, total)
    n_repeats = min(len(slots), round(repeat_fraction * total))
    repeat_at = set(rng.sample(list(slots), n_repeats))
    near = [k % 2 == 1 for k in range(n_repeats)]
    rng.shuffle(near)
    out: list[Request] = []
    for i in range(requests):
        images, kinds, origin = [], [], []
        for j in range(images_per_request):
            if i * images_per_request + j in repeat_at:
                base = rng.choice(sources)
                k = next(n for n, s in enumerate(sources) if s is base)
                origin.append(-1 - k if pool else k)
                if near.pop():
                    images.append(jpeg(base))
                    kinds.append("near")
                else:
                    images.append(png(base))
                    kinds.append("exact")
            else:
                image = factory.make()
                origin.append(len(seen))
                seen.append(image)
                images.append(png(image))
                kinds.append("unique")
        prompt = f"{PROMPTS[rng.randrange(len(PROMPTS))]} ({i})"
        out.append(Request(images, prompt, kinds, origin))
    return out
