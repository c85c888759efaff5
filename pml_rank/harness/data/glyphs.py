"""The embedded default data set: character glyphs rendered from the font files that ship
inside matplotlib. One class per character, one example per typeface and jitter draw.

Nothing is downloaded: the fonts are matplotlib's own (DejaVu and STIX, 16 faces), drawn
with Pillow's FreeType renderer. Generation is deterministic (a seeded generator drives the
jitter) and takes seconds; the result is cached as plain ``.npy`` files keyed by every
parameter and by the matplotlib, Pillow and FreeType versions, so the same installation
always reads the same bytes.

Why glyphs: they have hundreds of classes with a few dozen examples each, so held-out
classes (the Reality Check protocol tests on classes never seen in training) are
plentiful, and a small CNN trained for seconds clearly beats raw pixels and an untrained
network on them (see the README's benchmark), which a 10-class set like sklearn's digits
does not.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from .. import outputs

LOGGER = logging.getLogger(__name__)

# Faces that draw the character a code point names. Excluded from matplotlib's fonts:
# the Display and STIXNonUni/STIXSiz* faces (no ordinary characters), LastResort
# (placeholder boxes) and the BaKoMa Computer Modern faces (TeX encodings, where e.g.
# cmsy10's "A" is a calligraphic symbol).
FONT_FILES = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
)

# Basic Latin, Latin-1 letters and symbols, Greek and Cyrillic. Characters that every face
# lacks, that draw nothing, or that draw the same picture as an earlier character (Latin
# "A", Greek Alpha and Cyrillic A) are dropped, so no two classes are identical pictures.
CANDIDATE_CODE_POINTS = (
    tuple(range(0x21, 0x7F)) + tuple(range(0xA1, 0x100)) + tuple(range(0x391, 0x3CA)) + tuple(range(0x410, 0x450))
)

DEFAULT_CACHE_DIR = Path(os.environ.get("PML_RANK_CACHE", Path.home() / ".cache" / "pml-rank"))


def font_dir():
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


class GlyphDataset(torch.utils.data.Dataset):
    """Images ``(N, 1, size, size)`` as float in [0, 1] (ink = 1) with integer labels.

    Attributes: ``images`` (uint8 array), ``labels`` (int64 array), ``characters`` (the
    character of each label), ``fonts`` (the face of each image). ``dataset[i]`` returns
    ``(image_tensor, label)``, the form PML's trainers and testers expect.
    """

    def __init__(self, images, labels, characters, fonts):
        self.images = images
        self.labels = labels
        self.characters = characters
        self.fonts = fonts

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = torch.from_numpy(self.images[index]).float().div_(255).unsqueeze(0)
        return image, int(self.labels[index])

    def __getitems__(self, indices):
        """A batch at once (DataLoader and Subset use it): the same items as
        ``[self[i] for i in indices]``, converted in one operation."""
        images = torch.from_numpy(self.images[np.asarray(indices)]).float().div_(255).unsqueeze(1)
        return list(zip(images.unbind(0), self.labels[np.asarray(indices)].tolist()))


def _render(font, character, canvas, scale, angle, shift):
    """One glyph: baseline and horizontal centre at fixed places on a supersampled canvas
    (so "o" stays smaller than "O" and "," lower than "'"), then rotated, scaled and
    shifted."""
    from PIL import Image, ImageDraw

    image = Image.new("L", (canvas, canvas), 0)
    ImageDraw.Draw(image).text((canvas / 2, canvas * 0.72), character, fill=255, font=font, anchor="ms")
    if angle or scale != 1 or shift != (0, 0):
        # Inverse affine map about the centre: rotate by `angle`, scale by `scale`, then shift.
        c = canvas / 2
        cos, sin = np.cos(np.radians(angle)) / scale, np.sin(np.radians(angle)) / scale
        dx, dy = shift
        matrix = (cos, sin, c - cos * (c + dx) - sin * (c + dy), -sin, cos, c + sin * (c + dx) - cos * (c + dy))
        image = image.transform(image.size, Image.AFFINE, matrix, resample=Image.BILINEAR)
    return image


def generate(
    size=32,
    variants=2,
    max_rotation=8.0,
    max_shift=0.06,
    scale_range=(0.9, 1.1),
    seed=0,
    supersample=4,
    code_points=CANDIDATE_CODE_POINTS,
):
    """Renders the data set in memory and returns a `GlyphDataset`.

    Each (face, character) pair is drawn `variants` times with a random rotation in
    ``±max_rotation`` degrees, a scale in `scale_range` and a shift of up to `max_shift`
    of the image side, all from a generator seeded with `seed`. Labels number the
    characters in a fixed pseudo-random order (seeded too), so that "the first half of
    the classes" of the Reality Check protocol mixes scripts instead of being Latin only.
    """
    from PIL import Image, ImageFont

    canvas = size * supersample
    fonts = [ImageFont.truetype(str(font_dir() / name), size=int(canvas * 0.62)) for name in FONT_FILES]
    characters = _distinct_characters(fonts, canvas, code_points)
    order = np.random.default_rng(seed).permutation(len(characters))
    characters = [characters[i] for i in order]
    rng = np.random.default_rng(seed + 1)
    images, labels, font_names = [], [], []
    for label, character in enumerate(characters):
        for font_name, font in zip(FONT_FILES, fonts):
            for _ in range(variants):
                angle = rng.uniform(-max_rotation, max_rotation)
                scale = rng.uniform(*scale_range)
                shift = tuple(rng.uniform(-max_shift, max_shift, size=2) * canvas)
                big = _render(font, character, canvas, scale, angle, shift)
                small = big.resize((size, size), Image.BOX)
                images.append(np.asarray(small, dtype=np.uint8))
                labels.append(label)
                font_names.append(font_name)
    return GlyphDataset(np.stack(images), np.asarray(labels, dtype=np.int64), characters, font_names)


def _distinct_characters(fonts, canvas, code_points):
    """Candidate characters every face has, that draw something, and whose drawing in
    most faces differs from every earlier kept character's."""
    kept, seen = [], {}
    for code in code_points:
        character = chr(code)
        if not all(_has_glyph(font, character) for font in fonts):
            continue
        pictures = [np.asarray(_render(font, character, canvas, 1, 0, (0, 0))) for font in fonts]
        if min(p.max() for p in pictures) == 0:
            continue
        keys = [hashlib.sha1(p.tobytes()).hexdigest() for p in pictures]
        duplicates = sum(key in seen.get(i, ()) for i, key in enumerate(keys))
        if duplicates * 2 >= len(fonts):
            continue
        for i, key in enumerate(keys):
            seen.setdefault(i, set()).add(key)
        kept.append(character)
    return kept


def _has_glyph(font, character):
    # FreeType maps a missing character to glyph 0 (.notdef); Pillow exposes the mask.
    notdef = font.getmask("\uffff")
    mask = font.getmask(character)
    return mask.size != notdef.size or bytes(mask) != bytes(notdef)


def _versions():
    import matplotlib
    import PIL
    from PIL import features

    return {"matplotlib": matplotlib.__version__, "pillow": PIL.__version__, "freetype": features.version("freetype2")}


def load_glyphs(cache_dir=None, size=32, variants=2, seed=0, num_classes=None, **generate_kwargs):
    """The glyph data set, generated once and then read from
    ``<cache_dir>/glyphs-<key>/`` (default ``~/.cache/pml-rank``, or ``$PML_RANK_CACHE``).
    The key hashes every generation parameter and the matplotlib, Pillow and FreeType
    versions. `num_classes` keeps only the first classes (labels below it), for quick
    runs. Returns a `GlyphDataset`."""
    dataset = _load_or_generate(cache_dir, size=size, variants=variants, seed=seed, **generate_kwargs)
    if num_classes is None:
        return dataset
    if not 2 <= num_classes <= len(dataset.characters):
        raise ValueError(f"load_glyphs: num_classes must be between 2 and {len(dataset.characters)}, got {num_classes}")
    keep = dataset.labels < num_classes
    return GlyphDataset(
        dataset.images[keep],
        dataset.labels[keep],
        dataset.characters[:num_classes],
        [f for f, k in zip(dataset.fonts, keep) if k],
    )


CACHE_FILES = ("images.npy", "labels.npy", "meta.json")


def _read_cache(folder):
    """The cached data set in `folder`: ``(dataset, None)``, or ``(None, reason)`` when a
    file is missing, truncated, empty or inconsistent with the others."""
    files = [folder / name for name in CACHE_FILES]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        return None, f"{', '.join(missing)} missing"
    try:
        images, labels = np.load(files[0]), np.load(files[1])
        meta = json.loads(files[2].read_text(encoding="utf-8"))
        characters, fonts = list(meta["characters"]), list(meta["fonts"])
    except (OSError, ValueError, EOFError, KeyError, TypeError) as error:
        return None, f"unreadable ({type(error).__name__}: {error})"
    if (
        images.ndim != 3
        or images.dtype != np.uint8
        or labels.ndim != 1
        or not (len(images) == len(labels) == len(fonts))
        or (len(labels) and not (0 <= labels.min() and labels.max() < len(characters)))
    ):
        return None, (
            f"inconsistent (images {images.shape} {images.dtype}, labels {labels.shape}, "
            f"{len(fonts)} fonts, {len(characters)} characters)"
        )
    return GlyphDataset(images, labels, characters, fonts), None


def _write_cache(folder, dataset, key_source):
    """Writes the three cache files, each atomically; raises OSError."""
    folder.mkdir(parents=True, exist_ok=True)
    with outputs.atomic_write(folder / CACHE_FILES[0], "wb") as f:
        np.save(f, dataset.images)
    with outputs.atomic_write(folder / CACHE_FILES[1], "wb") as f:
        np.save(f, dataset.labels)
    outputs.write_text(
        folder / CACHE_FILES[2],
        json.dumps(
            {"characters": dataset.characters, "fonts": dataset.fonts, "source": json.loads(key_source)},
            ensure_ascii=False,
        ),
    )


def _load_or_generate(cache_dir, size, variants, seed, **generate_kwargs):
    params = dict(size=size, variants=variants, seed=seed, **generate_kwargs)
    key_source = json.dumps(
        {"params": params, "versions": _versions(), "fonts": FONT_FILES}, sort_keys=True, default=list
    )
    key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
    folder = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"glyphs-{key}"
    if folder.exists():
        dataset, problem = _read_cache(folder)
        if dataset is not None:
            return dataset
        LOGGER.warning("pml-rank: the glyph cache %s is damaged (%s); generating it again", folder, problem)
    dataset = generate(**params)
    try:
        _write_cache(folder, dataset, key_source)
    except OSError as error:
        LOGGER.warning(
            "pml-rank: cannot write the glyph cache %s (%s); using the glyphs generated in memory, "
            "which the next run generates again (set --cache-dir or $PML_RANK_CACHE to a writable "
            "folder)",
            folder,
            error.strerror or error,
        )
    return dataset
