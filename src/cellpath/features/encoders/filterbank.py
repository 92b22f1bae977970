"""A classical dense encoder: stain optical densities filtered by a fixed bank, pooled to tokens.

Input: (B, 3, H, W) RGB in [0, 1] (the registry's mean 0 / std 1 leave it so), H and W multiples of
the token stride. Steps, all deterministic and weight-free:

1. Colour deconvolution (Ruifrok & Johnston 2001): optical density OD = -log10(max(I, 1/255)) per
   RGB channel, unmixed into haematoxylin, eosin and DAB densities with the inverse of their unit
   OD vectors (kept linear: no clipping of negative densities).
2. Each stain map is filtered (reflect padding, FFT convolution) by: scale-normalised Gaussian
   derivatives G, Gx, Gy, Gxx, Gxy, Gyy and the Laplacian of Gaussian at σ = 1, 2, 4 px (21 linear
   responses), and Gabor quadrature pairs at wavelengths 4 and 8 px, orientations 0°, 45°, 90°,
   135° (8 energies sqrt(even² + odd²)).
3. Pooling over non-overlapping stride×stride cells: the mean and the mean absolute value of each
   linear response, the mean of each Gabor energy → 3 stains × (21 × 2 + 8) = 150 features/token.

Output of ``forward_features``: (B, (H/stride)·(W/stride), 150) tokens in row-major grid order, no
prefix tokens. Feature order: stain-major (H, E, DAB), then linear means, linear absolute means,
Gabor energies, each in kernel order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Unit optical-density vectors (rows) of haematoxylin, eosin and DAB in RGB (Ruifrok & Johnston).
STAIN_OD_VECTORS = ((0.650, 0.704, 0.286), (0.072, 0.990, 0.105), (0.268, 0.570, 0.776))
GAUSSIAN_SIGMAS_PX = (1.0, 2.0, 4.0)
GABOR_WAVELENGTHS_PX = (4.0, 8.0)
GABOR_ORIENTATIONS_DEG = (0.0, 45.0, 90.0, 135.0)
GABOR_SIGMA_PER_WAVELENGTH = 0.56  # about one octave of bandwidth
KERNEL_RADIUS_PX = 14  # ≥ 3σ of every Gaussian and Gabor envelope above
N_STAINS = 3
N_LINEAR = 7 * len(GAUSSIAN_SIGMAS_PX)
N_GABOR = len(GABOR_WAVELENGTHS_PX) * len(GABOR_ORIENTATIONS_DEG)
FEATURES_PER_TOKEN = N_STAINS * (2 * N_LINEAR + N_GABOR)


def gaussian_derivative_kernels(radius: int = KERNEL_RADIUS_PX) -> torch.Tensor:
    """(21, 2r+1, 2r+1) float64: per σ, G, Gx, Gy, Gxx, Gxy, Gyy, LoG (σ^order-normalised)."""
    axis = torch.arange(-radius, radius + 1, dtype=torch.float64)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    kernels = []
    for sigma in GAUSSIAN_SIGMAS_PX:
        g = torch.exp(-(x**2 + y**2) / (2 * sigma**2))
        g = g / g.sum()
        gx, gy = -x / sigma**2 * g, -y / sigma**2 * g
        gxx = (x**2 / sigma**4 - 1 / sigma**2) * g
        gyy = (y**2 / sigma**4 - 1 / sigma**2) * g
        gxy = x * y / sigma**4 * g
        kernels += [g, sigma * gx, sigma * gy, sigma**2 * gxx, sigma**2 * gxy, sigma**2 * gyy,
                    sigma**2 * (gxx + gyy)]
    return torch.stack(kernels)


def gabor_kernels(radius: int = KERNEL_RADIUS_PX) -> torch.Tensor:
    """(8, 2, 2r+1, 2r+1) float64: zero-mean even (cos) and odd (sin) Gabor pairs, unit L1 envelope."""
    axis = torch.arange(-radius, radius + 1, dtype=torch.float64)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    pairs = []
    for wavelength in GABOR_WAVELENGTHS_PX:
        sigma = GABOR_SIGMA_PER_WAVELENGTH * wavelength
        envelope = torch.exp(-(x**2 + y**2) / (2 * sigma**2))
        envelope = envelope / envelope.sum()
        for degrees in GABOR_ORIENTATIONS_DEG:
            theta = math.radians(degrees)
            phase = 2 * math.pi * (x * math.cos(theta) + y * math.sin(theta)) / wavelength
            even, odd = envelope * torch.cos(phase), envelope * torch.sin(phase)
            even = even - envelope * (even.sum() / envelope.sum())
            pairs.append(torch.stack([even, odd]))
    return torch.stack(pairs)


def stain_densities(rgb: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) RGB in [0, 1] → (B, 3, H, W) H, E, DAB optical densities (linear unmixing)."""
    vectors = torch.tensor(STAIN_OD_VECTORS, dtype=torch.float64)
    vectors = vectors / vectors.norm(dim=1, keepdim=True)
    unmix = torch.linalg.inv(vectors).to(rgb.dtype)  # OD_rgb (row) @ unmix = stain densities
    od = -torch.log10(rgb.clamp(min=1.0 / 255.0, max=1.0))
    return torch.einsum("bchw,cs->bshw", od, unmix)


class FilterBankEncoder(nn.Module):
    """Weight-free dense encoder; ``forward_features`` returns (B, tokens, 150), no prefix tokens."""

    num_prefix_tokens = 0
    num_features = FEATURES_PER_TOKEN

    def __init__(self, token_stride: int = 16):
        super().__init__()
        self.token_stride = token_stride
        linear = gaussian_derivative_kernels()
        gabor = gabor_kernels().flatten(0, 1)
        self.register_buffer("kernels", torch.cat([linear, gabor]).float(), persistent=False)

    def forward_features(self, rgb: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) RGB in [0, 1] → (B, H/stride · W/stride, 150) tokens, row-major grid."""
        height, width = rgb.shape[-2:]
        stride = self.token_stride
        if height % stride or width % stride:
            raise ValueError(f"filterbank-dense needs input sides that are multiples of {stride} px, "
                             f"got {height}×{width}")
        # Reflect-pad by whole tokens: circular FFT wrap-around stays inside the pad, and pooling the
        # padded responses then dropping the pad cells equals pooling the cropped responses.
        pad_cells = math.ceil((KERNEL_RADIUS_PX + 1) / stride)
        pad = pad_cells * stride
        padded = F.pad(stain_densities(rgb.float()), (pad, pad, pad, pad), mode="reflect")
        kernel_spectra = torch.fft.rfft2(_centre_at_origin(self.kernels, padded.shape[-2:]))
        # One image at a time: its maps stay in cache, about twice as fast as whole batches.
        tokens = torch.stack([self._image_tokens(image, kernel_spectra, pad_cells) for image in padded])
        return tokens.flatten(2).transpose(1, 2)

    def _image_tokens(self, padded: torch.Tensor, kernel_spectra: torch.Tensor, pad_cells: int) -> torch.Tensor:
        """(3, H', W') padded stain maps → (150, H/stride, W/stride) pooled features of one image."""
        stride, size = self.token_stride, padded.shape[-2:]
        spectrum = torch.fft.rfft2(padded)
        responses = (torch.fft.irfft2(spectrum * kernel_spectrum, s=size) for kernel_spectrum in kernel_spectra)

        def pool(maps: torch.Tensor) -> torch.Tensor:
            return F.avg_pool2d(maps, kernel_size=stride, stride=stride)[:, pad_cells:-pad_cells, pad_cells:-pad_cells]

        means, abs_means, energies = [], [], []
        for _ in range(N_LINEAR):
            response = next(responses)
            means.append(pool(response))
            abs_means.append(pool(response.abs()))
        for _ in range(N_GABOR):
            even, odd = next(responses), next(responses)
            energies.append(pool(torch.sqrt(even**2 + odd**2)))
        return torch.stack(means + abs_means + energies, dim=1).flatten(0, 1)


def _centre_at_origin(kernels: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """Embed (K, 2r+1, 2r+1) kernels in a ``size`` array with their centre at index (0, 0)."""
    radius = kernels.shape[-1] // 2
    canvas = kernels.new_zeros(len(kernels), *size)
    canvas[:, : 2 * radius + 1, : 2 * radius + 1] = kernels
    return torch.roll(canvas, shifts=(-radius, -radius), dims=(-2, -1))
