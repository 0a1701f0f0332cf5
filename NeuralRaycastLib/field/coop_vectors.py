"""One of the field's networks on cooperative vectors (shaders/coopvec_mlp.slang): its weights' half copy, made
again only when the weights change, and its weights' gradient sums over a pass, with their way back to the
field's gradients. The geometry network's sums come from the SDF fit's loss, the appearance network's from the
image loss: each network has its own buffers and its own gradient scale (CoopVecNetwork.gradientScale)."""

from __future__ import annotations

from typing import Any

from ..gpu.device import device_memory

#: sdf_fit.slang's numbers of the networks (coopVecToHalves, coopVecAddNetworkGradients)
NETWORKS = ("geometry", "appearance")
COOPVEC_FALLBACK = 0  # coopvec_mlp.slang's per-thread Kind
CONVERT_THREADS = 4096  # threads of the small kernels that convert the networks' weights and gradients
ROW_BYTES = 16  # a row of a layer's half weights spans a multiple of this


def padded_inputs(inputs: int) -> int:
    """A layer's inputs as the half copy holds them (coopvec_mlp.slang's CoopVecLayout.IP)."""
    halves = ROW_BYTES // 2
    return -(-inputs // halves) * halves


def network_layers(widths: list[int]) -> list[tuple[int, int]]:
    """The layers of a network of these widths as (outputs, inputs of the half copy), first to last."""
    return [(outputs, padded_inputs(inputs)) for inputs, outputs in zip(widths[:-1], widths[1:], strict=True)]


class CoopVectorNetwork:
    """One network's buffers on the device and the kernels that fill and read them (``module``: the field's module
    on cooperative vectors; ``kind``: its coopvec_mlp.slang Kind)."""

    def __init__(self, gpu: Any, module: Any, name: str, kind: int, widths: list[int], offset: int) -> None:
        import slangpy as spy

        self.gpu, self.module, self.kind = gpu, module, kind
        self.network = NETWORKS.index(name)
        self.layers = network_layers(widths)
        self.offset = offset  # the network's first parameter in the field's (kernel) layout
        #: The weights' gradients times this before their sums (coop_gradient_scale of a point's weight in the loss)
        self.gradient_scale = 1.0
        self.version: int | None = None  # the field's weights_version the half copy holds
        device = gpu.device
        usage = spy.BufferUsage.shader_resource | spy.BufferUsage.unordered_access
        self.sum_type = spy.DataType.float32 if kind != 1 else spy.DataType.float16
        self.offsets, self.row_major_offsets, at, floats = [], [], 0, 0
        for rows, cols in self.layers:
            self.offsets.append(at)
            size = 4 * rows * cols
            if kind != COOPVEC_FALLBACK:
                size = device.get_coop_vec_matrix_size(rows, cols, spy.CoopVecMatrixLayout.training_optimal,
                                                       self.sum_type)
            at += -(-size // 64) * 64
            self.row_major_offsets.append(floats)
            floats += rows * cols
        with device_memory(f"the {name} network on cooperative vectors"):
            halves = int(module.coopVecHalfCount(self.network))
            self.weights = device.create_buffer(size=2 * halves, usage=usage)
            self.sums = device.create_buffer(size=at, usage=usage)
            self.row_major = device.create_buffer(size=4 * floats, usage=usage)

    def struct(self, grads_address: int) -> dict[str, Any]:
        """The shaders' CoopVecNetwork (``grads_address``: the field's gradient buffer)."""
        return {"weights": self.weights.device_address, "weightGradients": self.sums,
                "gradientOffsets": self.offsets + [0] * (3 - len(self.offsets)),
                "biasGradients": grads_address + 4 * self.offset, "gradientScale": self.gradient_scale}

    def upload(self, values_address: int, weights_version: int, unless_current: bool = False) -> None:
        """The half copy from the field's parameters at ``values_address``; ``unless_current``: nothing where the
        copy holds version ``weights_version`` already (passes that only read the weights)."""
        import slangpy as spy

        if unless_current and self.version == weights_version:
            return
        self.module.coopVecToHalves(spy.grid((CONVERT_THREADS,)), CONVERT_THREADS, self.network,
                                    values_address + 4 * self.offset, self.weights.device_address)
        self.version = weights_version

    def clear_sums(self) -> None:
        """The weights' gradient sums zeroed (before a pass that trains the network)."""
        encoder = self.gpu.device.create_command_encoder()
        encoder.clear_buffer(self.sums)
        self.gpu.device.submit_command_buffer(encoder.finish())

    def add_gradients(self, grads_address: int) -> None:
        """Add the weights' gradient sums of a pass to the field's gradients: on the device each layer's matrix
        converted from the training-optimal layout to row-major first (of the sums' own type: the conversion
        changes the layout, not the type)."""
        import slangpy as spy

        sums, offsets, halves = self.sums, self.offsets, 0
        if self.kind != COOPVEC_FALLBACK:
            device, encoder = self.gpu.device, self.gpu.device.create_command_encoder()
            halves = int(self.sum_type == spy.DataType.float16)
            for (rows, cols), offset, target in zip(self.layers, self.offsets, self.row_major_offsets, strict=True):
                encoder.convert_coop_vec_matrix(
                    self.row_major,
                    device.create_coop_vec_matrix_desc(rows, cols, spy.CoopVecMatrixLayout.row_major, self.sum_type,
                                                       (2 if halves else 4) * target),
                    sums, device.create_coop_vec_matrix_desc(rows, cols, spy.CoopVecMatrixLayout.training_optimal,
                                                             self.sum_type, offset))
            device.submit_command_buffer(encoder.finish())
            sums, offsets = self.row_major, self.row_major_offsets
        else:
            offsets = [offset // 4 for offset in offsets]
        self.module.coopVecAddNetworkGradients(spy.grid((CONVERT_THREADS,)), CONVERT_THREADS, self.network,
                                               sums.device_address, offsets + [0] * (3 - len(offsets)), halves,
                                               1.0 / self.gradient_scale, grads_address + 4 * self.offset)
