"""The papers' backbones from torchvision, with ImageNet weights read only from the local
torch cache (``torch.hub.get_dir()/checkpoints``). Nothing is downloaded: when a weights
file is absent, `WeightsNotFoundError` says which file to place where.

`build_trunk` returns the trunk without its classifier (pooled features); the runner adds a
linear embedder to the budget's embedding size (`runner.model_factories`).

torchvision has no BN-Inception (Reality Check's trunk). Its closest model is GoogLeNet,
which torchvision builds with batch normalisation after every convolution: Inception-v1
blocks with BatchNorm, 1024 pooled features, 224-pixel inputs, as BN-Inception. We use it
for the Reality Check tables and say so in the output.
"""

import dataclasses
import os

import torch


def _torchvision_models():
    """torchvision.models, imported on first use: importing it loads torch's compiler (over
    a second at every start of ``pml-rank``), which the small CNN never needs."""
    import torchvision.models

    return torchvision.models


class WeightsNotFoundError(FileNotFoundError):
    """Pretrained weights are not in the local torch cache. The message says which file to
    place where."""


@dataclasses.dataclass(frozen=True)
class Backbone:
    name: str
    builder: str  # torchvision.models function
    weights: str  # torchvision weights enum member, "ResNet50_Weights.IMAGENET1K_V1"
    features: int  # size of the pooled features the embedder reads
    note: str = ""

    def weights_enum(self):
        enum_name, member = self.weights.split(".")
        return getattr(getattr(_torchvision_models(), enum_name), member)

    def weights_file(self):
        """Where torchvision's own cache would keep the weights file."""
        url = self.weights_enum().url
        return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))


BACKBONES = {
    b.name: b
    for b in (
        Backbone("resnet50", "resnet50", "ResNet50_Weights.IMAGENET1K_V1", 2048),
        Backbone("googlenet", "googlenet", "GoogLeNet_Weights.IMAGENET1K_V1", 1024),
        Backbone(
            "bn-inception",
            "googlenet",
            "GoogLeNet_Weights.IMAGENET1K_V1",
            1024,
            note="torchvision has no BN-Inception; GoogLeNet with BatchNorm stands in",
        ),
    )
}


def missing_weights_message(backbone):
    path = backbone.weights_file()
    url = backbone.weights_enum().url
    return (
        f"Pretrained ImageNet weights for {backbone.name} not found: {path}\n"
        f"Place the file {os.path.basename(path)} there (it is torchvision's {backbone.weights}, "
        f"published at {url}; copy it from a machine with network access). The folder is "
        f"torch.hub.get_dir()/checkpoints: set TORCH_HOME to use another one. Or pass "
        "--random-init to train from scratch (not the papers' setting). pml-rank never downloads."
    )


def require_weights(name):
    """Raise `WeightsNotFoundError` unless the backbone's ImageNet weights are cached."""
    backbone = BACKBONES[name]
    if not os.path.isfile(backbone.weights_file()):
        raise WeightsNotFoundError(missing_weights_message(backbone))


def build_trunk(name, pretrained=True, load_weights=True):
    """A torchvision trunk whose output is its pooled features (the classifier replaced
    by the identity). ``pretrained=True`` loads ImageNet weights from the local cache;
    with ``load_weights=False`` it builds the same network (GoogLeNet's input transform
    included) without reading them, for weights loaded afterwards."""
    if name not in BACKBONES:
        raise ValueError(f"pml-rank: unknown backbone {name!r}; known: {', '.join(BACKBONES)}")
    backbone = BACKBONES[name]
    build = getattr(_torchvision_models(), backbone.builder)
    options = {}
    if backbone.builder == "googlenet":
        # No auxiliary classifiers; torchvision's ImageNet GoogLeNet expects its input transform.
        options = {"aux_logits": False, "init_weights": not pretrained, "transform_input": pretrained}
    trunk = build(weights=None, **options)
    if pretrained and load_weights:
        require_weights(name)
        state = torch.load(backbone.weights_file(), map_location="cpu", weights_only=True)
        state = {k: v for k, v in state.items() if not k.startswith(("aux1.", "aux2."))}
        trunk.load_state_dict(state)
    trunk.fc = torch.nn.Identity()
    return trunk
