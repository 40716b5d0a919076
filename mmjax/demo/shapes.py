"""Synthetic "shapes" scenes and questions for the mmjax-shapes demo VLM (issue 7).

Contract (what the shipped model is trained and evaluated on):

* Canvas: width and height each in [96, 512] px (independently, so not necessarily square),
  plain white background.
* 1 to 3 filled shapes that do not overlap (their bounding boxes, grown by a small gap, are
  disjoint, so the shapes themselves are disjoint too).
* Shape in {circle, square, triangle}; color in {red, green, blue, yellow}.
* Size of each shape (bounding-box side: circle diameter, square side, triangle base = height)
  is 15-35% of the shorter canvas side; positions are uniform over the canvas.
* The image may reach the model as PNG or JPEG (quality >= 85): see `encode_like_client`.

Questions and exact answers (lower case, no final period):

====================  ==========================  =====================================
type                  question                    answer
====================  ==========================  =====================================
``shape``             What shape is this?         circle | square | triangle (1 shape)
``color``             What color is the shape?    red | green | blue | yellow (1 shape)
``count``             How many shapes are there?  1 | 2 | 3
``exists``            Is there a <color> <shape>? yes | no
``describe``          Describe the image.         shapes left to right by center x:
                                                  "a red circle", "a red circle and a blue
                                                  square", "a red circle, a blue square and
                                                  a green triangle"
====================  ==========================  =====================================

JSON answers: with the system prompt ``JSON_SYSTEM`` before the question, the single-value
questions (``shape``, ``color``, ``count``) are answered as a one-key JSON object:
``{"shape": "circle"}``, ``{"color": "red"}``, ``{"count": 2}`` (`json_answer`; the training
question types ``shape_json`` / ``color_json`` / ``count_json``).

Everything here is host-side numpy/Pillow; the generator is deterministic given a
``numpy.random.Generator``.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLORS = ("red", "green", "blue", "yellow")

# Canonical RGB of each color (what `draw_scene(..., color_jitter=False)` paints).
CANONICAL_RGB = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 20),
}

# Per-channel ranges a jittered color is drawn from.  They cover the usual ways people paint
# these names (PIL/CSS "red" (255,0,0), "green" (0,128,0), "lime" (0,255,0), "blue" (0,0,255),
# "yellow" (255,255,0), and softer matplotlib-like tones) while keeping the four classes
# separable: red = high R, low G; green = G dominant; blue = B dominant; yellow = high R and G.
_COLOR_RANGES = {
    "red": ((180, 255), (0, 70), (0, 70)),
    "green": ((0, 80), (110, 255), (0, 90)),
    "blue": ((0, 80), (0, 110), (160, 255)),
    "yellow": ((210, 255), (190, 255), (0, 80)),
}

MIN_SIDE, MAX_SIDE = 96, 512
MIN_FRAC, MAX_FRAC = 0.15, 0.35
MAX_SHAPES = 3

QUESTION_TYPES = ("shape", "color", "count", "exists", "describe")
Q_SHAPE = "What shape is this?"
Q_COLOR = "What color is the shape?"
Q_COUNT = "How many shapes are there?"
Q_DESCRIBE = "Describe the image."
# The single-value question types that also have a JSON form (see `json_answer`).
JSON_TYPES = ("shape", "color", "count")
JSON_SYSTEM = "Answer the question in JSON."
_EXISTS_RE = re.compile(r"^is there an? (\w+) (\w+)\?$")


@dataclass(frozen=True)
class Shape:
    kind: str            # "circle" | "square" | "triangle"
    color: str           # "red" | "green" | "blue" | "yellow"
    cx: float            # center x in canvas pixels (center of the bounding box)
    cy: float            # center y
    size: float          # bounding-box side in pixels
    rgb: tuple = (0, 0, 0)

    @property
    def bbox(self) -> tuple[float, float, float, float]:
        h = self.size / 2
        return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)

    @property
    def phrase(self) -> str:
        return f"a {self.color} {self.kind}"


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    shapes: tuple = field(default_factory=tuple)   # tuple[Shape, ...] in drawing order

    @property
    def count(self) -> int:
        return len(self.shapes)

    def left_to_right(self) -> list:
        """Shapes sorted by center x (ties, which `draw_scene` avoids, broken by center y)."""
        return sorted(self.shapes, key=lambda s: (s.cx, s.cy))

    def has(self, color: str, kind: str) -> bool:
        return any(s.color == color and s.kind == kind for s in self.shapes)

    def to_dict(self) -> dict:
        return {"width": self.width, "height": self.height,
                "shapes": [dict(kind=s.kind, color=s.color, cx=s.cx, cy=s.cy, size=s.size,
                                rgb=list(s.rgb)) for s in self.shapes]}


def describe(scene: Scene) -> str:
    """'a red circle', 'a red circle and a blue square', 'a, b and c' (left to right)."""
    parts = [s.phrase for s in scene.left_to_right()]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _sample_rgb(rng: np.random.Generator, color: str, jitter: bool) -> tuple:
    if not jitter:
        return CANONICAL_RGB[color]
    return tuple(int(rng.integers(lo, hi + 1)) for lo, hi in _COLOR_RANGES[color])


def _boxes_disjoint(a, b, gap: float) -> bool:
    return (a[2] + gap <= b[0] or b[2] + gap <= a[0] or
            a[3] + gap <= b[1] or b[3] + gap <= a[1])


def sample_layout(rng: np.random.Generator, width: int, height: int, n: int, *,
                  min_gap: float = 2.0, min_dx_frac: float = 0.04,
                  max_tries: int = 200) -> list | None:
    """Random (cx, cy, size) for n shapes, bounding boxes disjoint by `min_gap` px and centers
    at least `min_dx_frac` * width apart in x (so "left to right" is never a coin toss at the
    model's resolution). Returns None when the tries run out (caller resamples)."""
    short = min(width, height)
    placed: list = []
    tries = 0
    while len(placed) < n:
        tries += 1
        if tries > max_tries:
            return None
        size = float(rng.uniform(MIN_FRAC, MAX_FRAC) * short)
        h = size / 2
        cx = float(rng.uniform(h, width - h))
        cy = float(rng.uniform(h, height - h))
        box = (cx - h, cy - h, cx + h, cy + h)
        if all(_boxes_disjoint(box, (x - s / 2, y - s / 2, x + s / 2, y + s / 2), min_gap)
               and abs(cx - x) >= min_dx_frac * width for x, y, s in placed):
            placed.append((cx, cy, size))
    return placed


def _draw_shape(draw: ImageDraw.ImageDraw, s: Shape, scale: int) -> None:
    x0, y0, x1, y1 = (v * scale for v in s.bbox)
    # PIL's polygon/ellipse include the far edge pixel: pull it in by one so a shape of size
    # `size` paints `size` pixels (keeps the 15-35% contract honest at small sizes).
    x1 -= 1
    y1 -= 1
    if s.kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=s.rgb)
    elif s.kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=s.rgb)
    elif s.kind == "triangle":   # isosceles, apex up, base = height = size
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=s.rgb)
    else:
        raise ValueError(f"unknown shape {s.kind!r}")


def sample_scene(rng: np.random.Generator, *, n_shapes: int | None = None,
                 width: int | None = None, height: int | None = None,
                 color_jitter: bool = True) -> Scene:
    """A random Scene (no pixels): canvas size, 1-3 shapes, kinds, colors, layout, RGB."""
    while True:
        w = int(width if width is not None else rng.integers(MIN_SIDE, MAX_SIDE + 1))
        h = int(height if height is not None else rng.integers(MIN_SIDE, MAX_SIDE + 1))
        n = int(n_shapes if n_shapes is not None else rng.integers(1, MAX_SHAPES + 1))
        layout = sample_layout(rng, w, h, n)
        if layout is not None:
            break
    shapes = []
    for cx, cy, size in layout:
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        color = COLORS[int(rng.integers(len(COLORS)))]
        shapes.append(Shape(kind, color, cx, cy, size, _sample_rgb(rng, color, color_jitter)))
    return Scene(w, h, tuple(shapes))


def render_scene(scene: Scene, *, antialias: bool = False) -> Image.Image:
    """Paint a Scene on a white canvas. antialias renders at 4x and box-downsamples."""
    scale = 4 if antialias else 1
    img = Image.new("RGB", (scene.width * scale, scene.height * scale), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for s in scene.shapes:
        _draw_shape(draw, s, scale)
    if scale > 1:
        img = img.resize((scene.width, scene.height), Image.Resampling.BOX)
    return img


def draw_scene(rng: np.random.Generator, *, n_shapes: int | None = None,
               width: int | None = None, height: int | None = None,
               color_jitter: bool = True, antialias: bool | None = None,
               ) -> tuple[Image.Image, Scene]:
    """Draw one random scene following the contract. Returns (RGB PIL image, Scene).

    n_shapes / width / height pin those choices (tests, evaluation slices); color_jitter
    varies each color's RGB inside its class range; antialias (None = random) renders at 4x
    and downsamples, so the model sees both hard and soft edges.
    """
    scene = sample_scene(rng, n_shapes=n_shapes, width=width, height=height,
                         color_jitter=color_jitter)
    aa = bool(rng.integers(2)) if antialias is None else antialias
    return render_scene(scene, antialias=aa), scene


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def exists_question(color: str, kind: str) -> str:
    return f"Is there {_article(color)} {color} {kind}?"


def _exists_negative(rng: np.random.Generator, scene: Scene) -> tuple[str, str]:
    """An absent (color, shape) pair; 80% of the time a hard one: the color of a present shape
    with another shape, or the shape of a present one in another color."""
    absent = [(c, k) for c in COLORS for k in SHAPES if not scene.has(c, k)]
    if rng.random() < 0.8:
        hard = [(c, k) for c, k in absent
                if any(s.color == c or s.kind == k for s in scene.shapes)]
        if hard:
            absent = hard
    return absent[int(rng.integers(len(absent)))]


def make_question(rng: np.random.Generator, scene: Scene, qtype: str | None = None,
                  ) -> tuple[str, str]:
    """(question, exact answer) about `scene`. qtype=None draws uniformly among the types that
    apply ("shape"/"color" only for one-shape scenes). "exists" is yes/no 50/50."""
    if qtype is None:
        types = QUESTION_TYPES if scene.count == 1 else ("count", "exists", "describe")
        qtype = types[int(rng.integers(len(types)))]
    if qtype in ("shape", "color") and scene.count != 1:
        raise ValueError(f"{qtype!r} questions need a one-shape scene, got {scene.count}")
    if qtype == "shape":
        return Q_SHAPE, scene.shapes[0].kind
    if qtype == "color":
        return Q_COLOR, scene.shapes[0].color
    if qtype == "count":
        return Q_COUNT, str(scene.count)
    if qtype == "describe":
        return Q_DESCRIBE, describe(scene)
    if qtype == "exists":
        if rng.random() < 0.5:
            s = scene.shapes[int(rng.integers(scene.count))]
            return exists_question(s.color, s.kind), "yes"
        c, k = _exists_negative(rng, scene)
        return exists_question(c, k), "no"
    raise ValueError(f"unknown question type {qtype!r}; expected one of {QUESTION_TYPES}")


def json_answer(qtype: str, answer: str) -> str:
    """The JSON form of a shape / color / count answer: '{"shape": "circle"}', '{"count": 2}'
    (the count a JSON integer, the names strings), spaced separators as json.dumps writes them."""
    import json
    if qtype not in JSON_TYPES:
        raise ValueError(f"only {JSON_TYPES} questions have a JSON answer, got {qtype!r}")
    return json.dumps({qtype: int(answer) if qtype == "count" else answer})


def json_schema(first: str) -> dict:
    """A JSON schema of all three single values, {"shape": enum, "color": enum, "count": 0-9},
    with `first` (the asked one) as the first key: the model answers a JSON question with that
    key first (`json_answer`), and the grammar then adds the other two. Spaced separators (an
    llguidance "x-guidance" option) as `json_answer` writes them."""
    props = {"shape": {"enum": list(SHAPES)}, "color": {"enum": list(COLORS)},
             "count": {"type": "integer", "minimum": 0, "maximum": 9}}
    order = [first] + [k for k in props if k != first]
    return {"x-guidance": {"key_separator": ": ", "item_separator": ", "}, "type": "object",
            "properties": {k: props[k] for k in order}, "required": order, "additionalProperties": False}


def json_matches(pred: str, qtype: str, gold: str) -> bool:
    """A JSON answer (`json_answer`, maybe with more keys) carries the gold value of `qtype`."""
    import json
    try:
        obj = json.loads(pred)
    except ValueError:
        return False
    return isinstance(obj, dict) and str(obj.get(qtype)) == gold


def exists_target(question: str) -> tuple[str, str] | None:
    """(color, kind) an "Is there a <color> <shape>?" question asks about, else None."""
    m = _EXISTS_RE.match(question.strip().lower())
    return (m.group(1), m.group(2)) if m else None


def question_type(question: str) -> str:
    """Inverse of make_question's templates (for per-type accuracy)."""
    q = question.strip()
    fixed = {Q_SHAPE: "shape", Q_COLOR: "color", Q_COUNT: "count", Q_DESCRIBE: "describe"}
    if q in fixed:
        return fixed[q]
    if exists_target(q):
        return "exists"
    raise ValueError(f"not a shapes question: {question!r}")


def encode_bytes(img: Image.Image, rng: np.random.Generator, fmt: str | None = None,
                 ) -> tuple[bytes, str]:
    """Encode like a client would: PNG or JPEG (quality 85-95), 50/50 unless fmt is given."""
    fmt = fmt or ("PNG" if rng.random() < 0.5 else "JPEG")
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, format="JPEG", quality=int(rng.integers(85, 96)))
    elif fmt == "PNG":
        img.save(buf, format="PNG")
    else:
        raise ValueError(f"fmt must be PNG or JPEG, got {fmt!r}")
    return buf.getvalue(), fmt


def encode_like_client(img: Image.Image, rng: np.random.Generator, fmt: str | None = None,
                       ) -> Image.Image:
    """Round-trip through PNG or JPEG (quality 85-95) and decode back to RGB."""
    data, _ = encode_bytes(img, rng, fmt)
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def normalize_answer(text: str) -> str:
    t = " ".join(text.strip().lower().split())
    if t.endswith("."):
        t = t[:-1].rstrip()
    return t


def answer_matches(pred: str, gold: str) -> bool:
    """Exact match after strip, lower case, whitespace collapse and dropping a final period."""
    return normalize_answer(pred) == normalize_answer(gold)


def make_example(rng: np.random.Generator, qtype: str | None = None, *,
                 client_roundtrip: bool = True, **scene_kw) -> dict:
    """One training/eval example: {image, scene, question, answer, qtype}.

    The question type is drawn first (uniform over the five, see `sample_qtype`); "shape" and
    "color" then pin the scene to one shape, the others draw 1-3 shapes uniformly.
    """
    qtype = qtype or sample_qtype(rng)
    if qtype in ("shape", "color"):
        scene_kw.setdefault("n_shapes", 1)
    img, scene = draw_scene(rng, **scene_kw)
    if client_roundtrip:
        img = encode_like_client(img, rng)
    q, a = make_question(rng, scene, qtype)
    return {"image": img, "scene": scene, "question": q, "answer": a, "qtype": qtype}


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def preprocess(img: Image.Image, image_size: int = 128) -> np.ndarray:
    """Pixels as the shipped CLIPImageProcessor makes them: squash (no crop) to
    image_size x image_size with PIL bicubic, /255, CLIP mean/std. float32 [3, H, W]."""
    x = img.convert("RGB").resize((image_size, image_size), Image.Resampling.BICUBIC)
    x = np.asarray(x, dtype=np.float32) / 255.0
    x = (x - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def sample_qtype(rng: np.random.Generator) -> str:
    """Uniform over the five question types."""
    return QUESTION_TYPES[int(rng.integers(len(QUESTION_TYPES)))]
