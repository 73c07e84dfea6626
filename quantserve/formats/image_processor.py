"""A vision checkpoint's image-processor settings, read once for every user: where transformers finds them
(formats.hf_config.image_processor_settings), parsed as transformers parses them, and checked against the vision
tower they feed. The torch backend preprocesses with them (vision/preprocess.py), the mmproj writer copies the
mean and std into llama.cpp's projector file, and both refuse a checkpoint whose images would not fit its tower.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError
from quantserve.formats.hf_config import image_processor_settings

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image processor's settings (preprocessor_config.json, or processor_config.json's image_processor), with
    llava-hf/llava-1.5-7b-hf's values where a key is missing.

    `size` is either {"shortest_edge": n} (-> shortest_edge) or {"height", "width"} (-> resize_to, exact).
    do_pad defaults to False as in transformers' LlavaImageProcessor; llava-hf's LLaVA 1.5 configs that want the
    original repo's pad-to-square say "do_pad": true. do_convert_rgb is kept for completeness: an Image's pixels are
    always RGB already (quantserve.vision.images.to_rgb, the same conversion).
    """

    do_resize: bool = True
    shortest_edge: int | None = 336
    resize_to: tuple[int, int] | None = None  # (height, width)
    resample: int = 3  # PIL's BICUBIC, as transformers' default
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (336, 336)  # (height, width)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_pad: bool = False
    do_convert_rgb: bool = True
    source: str = "no image processor settings: llava-hf's LLaVA 1.5 defaults"  # where they came from

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], *, source: str = "preprocessor_config.json"
    ) -> ImageProcessorConfig:
        """Parse the JSON object; unknown keys are ignored, as transformers does."""
        known = {f.name for f in fields(cls)} - {"shortest_edge", "resize_to", "crop_size", "source"}
        kw: dict[str, Any] = {k: d[k] for k in known if k in d}
        try:
            for k in ("image_mean", "image_std"):
                if k in kw:
                    v = kw[k]
                    kw[k] = tuple(float(x) for x in v) if isinstance(v, list) else (float(v),) * 3
            if (
                "size" in d
            ):  # an int is the shortest edge (old CLIP configs, like transformers' get_size_dict)
                size = d["size"] if isinstance(d["size"], dict) else {"shortest_edge": d["size"]}
                if "shortest_edge" in size and "longest_edge" not in size:
                    kw["shortest_edge"] = int(size["shortest_edge"])
                elif {"height", "width"} <= size.keys():
                    kw["shortest_edge"], kw["resize_to"] = None, (int(size["height"]), int(size["width"]))
                else:
                    raise ValueError(f"size {size} (supported: shortest_edge, or height and width)")
            if "crop_size" in d:
                c = d["crop_size"]
                kw["crop_size"] = (
                    (int(c["height"]), int(c["width"])) if isinstance(c, dict) else (int(c), int(c))
                )
            cfg = cls(**kw, source=source)
        except (TypeError, ValueError, KeyError) as e:
            raise ModelFileError(f"{source}: cannot read the image processor settings: {e}") from None
        if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
            raise ModelFileError(f"{source}: image_mean and image_std need 3 values (RGB)")
        return cfg

    @classmethod
    def from_dir(cls, model_dir: Path) -> ImageProcessorConfig:
        """The checkpoint's settings, wherever transformers finds them (formats.hf_config.image_processor_settings);
        all defaults if it has none."""
        found = image_processor_settings(Path(model_dir))
        if found is None:
            return cls()
        settings, source = found
        return cls.from_dict(settings, source=source)

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every image this produces, or None when that depends on the image (a resize that
        keeps the aspect ratio, with no centre crop after it)."""
        if self.do_center_crop:
            return self.crop_size
        if self.do_resize and self.resize_to is not None:
            return self.resize_to
        return None


def check_tower(cfg: ImageProcessorConfig, vision_config: dict[str, Any]) -> None:
    """Refuse, at load, an image processor whose images the vision tower cannot take: CLIP's position embeddings
    are fixed for image_size x image_size, (image_size / patch_size)^2 patches and a class position.

    Raises:
        ModelFileError: naming both sizes, their position counts, and where each number came from.
    """
    size = int(vision_config.get("image_size", 336))
    patch = int(vision_config.get("patch_size", 14))
    tower = f"the vision tower takes {size}x{size} images ({(size // patch) ** 2 + 1} positions at patch {patch}; " \
        "config.json's vision_config)"  # fmt: skip
    out = cfg.output_size()
    if out is None:
        raise ModelFileError(
            f"the image processor ({cfg.source}) resizes keeping each image's aspect ratio with no centre crop, "
            f"so its images have no fixed size, but {tower}; set do_center_crop with crop_size {size}"
        )
    if out != (size, size):
        h, w = out
        positions = (h // patch) * (w // patch) + 1
        raise ModelFileError(
            f"the image processor ({cfg.source}) makes {h}x{w} images ({positions} positions), but {tower}; "
            "the two must agree: fix crop_size (and size) or the tower's image_size"
        )
