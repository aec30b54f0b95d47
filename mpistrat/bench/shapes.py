"""Model shapes for benchmarks and tests: ResNet-50's gradients."""

from __future__ import annotations

__all__ = ["resnet50_gradient_shapes"]


def resnet50_gradient_shapes() -> tuple[tuple[int, ...], ...]:
    """The 161 trainable-variable (gradient) shapes of ResNet-50 v1, in creation order.

    conv1 7x7x3x64 and its batch norm, then bottleneck stages of [3, 4, 6, 3] blocks
    (widths 64, 128, 256, 512; outputs 4x wider): each block's first conv is preceded,
    in the first block of a stage, by the 1x1 projection shortcut and its batch norm
    (Keras creates the shortcut first); then 1x1, 3x3, 1x1 convs, each followed by a
    batch norm. Convs have no bias (batch norm follows); each batch norm has a gamma and
    a beta of shape ``(C,)``. Last the fc layer, ``(2048, 1000)`` and ``(1000,)``. That
    is 53 kernels + 106 batch-norm vectors + 2 = 161 tensors and 25,557,032 elements.
    Kernels are HWIO (TF's layout).
    """
    shapes: list[tuple[int, ...]] = []

    def conv_bn(k: int, cin: int, cout: int) -> None:
        shapes.extend([(k, k, cin, cout), (cout,), (cout,)])

    conv_bn(7, 3, 64)
    cin = 64
    for blocks, width in zip((3, 4, 6, 3), (64, 128, 256, 512)):
        cout = 4 * width
        for block in range(blocks):
            if block == 0:
                conv_bn(1, cin, cout)
            conv_bn(1, cin, width)
            conv_bn(3, width, width)
            conv_bn(1, width, cout)
            cin = cout
    shapes.extend([(2048, 1000), (1000,)])
    return tuple(shapes)
