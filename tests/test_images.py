"""The images the Kubernetes manifests name are the images deploy/docker builds (issue 38).

Images cannot be built on these machines (no Docker daemon), so this reads what would build
them: every `image:` in every manifest under deploy/kubernetes (the files as written, so no
kubectl is needed; the rendered overlays too where kubectl is installed) must be the tag a
`docker build -f deploy/docker/<name>.Dockerfile -t <tag> .` line in that Dockerfile's header
produces, the tag must be the project's version, and the README must give the same command.
tests/test_install_script.py runs the install those Dockerfiles run.
"""

from __future__ import annotations

import ast
import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "deploy" / "docker"
BUILD_RE = re.compile(
    r"docker build -f (deploy/docker/\S+\.Dockerfile)(?: --build-arg \S+)* -t (\S+) \."
)


def images_in(node: Any) -> Iterator[str]:
    """Every container's image in a manifest or a kustomize patch, however deep."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c["image"] for c in value if isinstance(c, dict) and "image" in c)
            else:
                yield from images_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from images_in(item)


def manifest_images() -> dict[str, set[str]]:
    """image -> the manifest files that name it."""
    found: dict[str, set[str]] = {}
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for image in images_in(doc):
                found.setdefault(image, set()).add(str(path.relative_to(ROOT)))
    return found


def build_commands(text: str) -> list[tuple[str, str]]:
    """(Dockerfile, tag) of each `docker build` command in a text."""
    return BUILD_RE.findall(text)


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_every_image_a_manifest_names_is_built_by_its_dockerfile() -> None:
    images = manifest_images()
    assert {i.split(":")[0] for i in images} == {"afd-ctl", "afd-vllm"}, images
    for image, files in images.items():
        name, _, tag = image.partition(":")
        assert tag == project_version(), f"{image} in {files}: tag it with the project's version"
        dockerfile = DOCKER / f"{name}.Dockerfile"
        assert dockerfile.is_file(), f"{image} in {files}: no {dockerfile.relative_to(ROOT)}"
        header = dockerfile.read_text()
        assert (str(dockerfile.relative_to(ROOT)), image) in build_commands(header), (
            f"{dockerfile.name} says no `docker build ... -t {image} .` ({files} name it)"
        )
        assert "scripts/install_afd.sh" in header
        assert "no Docker daemon" in header  # says why it is not built here
    # Where kubectl renders the overlays, what they deploy holds no other image (kustomize
    # `images:` in an overlay of the project's would show here).
    if shutil.which("kubectl"):
        from tests.kube_pods import render
        from tests.test_kubernetes_manifests import OVERLAYS

        rendered = {i for overlay in OVERLAYS for i in images_in(render(overlay))}
        assert rendered <= set(images), rendered - set(images)


def test_the_readme_builds_the_tags_the_manifests_name() -> None:
    readme = build_commands((ROOT / "README.md").read_text())
    assert set(manifest_images()) <= {tag for _, tag in readme}, readme
    for dockerfile, tag in readme:
        assert (dockerfile, tag) in build_commands((ROOT / dockerfile).read_text()), (
            f"README builds {tag} from {dockerfile}, which does not say so"
        )


def test_the_vllm_image_starts_from_vllms_own_image_at_a_supported_line() -> None:
    from vllm_ext.compat import SUPPORTED_LINES

    text = (DOCKER / "afd-vllm.Dockerfile").read_text()
    default = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\d+\.\d+)\.\d+$", text, re.M)
    assert default and default.group(1) == SUPPORTED_LINES[0], "0.26: the H200 machines' line"
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", text, re.M)
    for line in re.findall(r"VLLM_IMAGE=vllm/vllm-openai:v(\d+\.\d+)\.\d+", text):
        assert line in SUPPORTED_LINES, line
    # The install refuses the lines the plugin does not support: the same list.
    script = (ROOT / "scripts" / "install_afd.sh").read_text()
    refused = re.search(r"not in (\(.*?\)):", script)
    assert refused and ast.literal_eval(refused.group(1)) == SUPPORTED_LINES, "install_afd.sh"
    ctl = (DOCKER / "afd-ctl.Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim$", ctl, re.M)
    assert "install_afd.sh daemon" in ctl and "install_afd.sh plugin" in text
