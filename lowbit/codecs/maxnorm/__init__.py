"""All-reduce compatible stochastic quantizers with a norm shared by MAX over the
workers (paper 004, "Unbiased single-scale and multi-scale quantizers for
distributed optimization": QSGDMaxNorm, section 3.1, eqs. 7-9, Lemma 1,
Algorithm 1; QSGDMaxNormMultiScale, section 3.2, eqs. 10-13, Lemma 2,
Algorithm 2)::

    codec = QSGDMaxNormCodec()                  # bits=3: the paper's "QSGD-MN 2"
    W = max over workers of codec.shared_scale(x)      # one MAX all-reduce
    s = sum over workers of codec.encode_int(x, W, generator)   # one SUM all-reduce
    average = codec.decode_sum(s, W, world_size)

Single scale. All workers agree on ``W = max_m ||x_m||`` (a MAX all-reduce of
one float32). With ``a_i = |x_i| / W`` in ``[0, 1]`` each worker sends the
integer ``code_i = sign(x_i) * s * xi_i``, where ``s * xi_i`` is ``s * a_i``
rounded stochastically to one of its two neighbouring integers (eq. 8), so
``E[code_i] = s * x_i / W``. Codes of all workers are summed as integers and
``W * sum / (s * M)`` is the average of the workers' reconstructions (eq. 9).

Bits and levels. ``bits`` is the number of bits each coordinate takes on the
wire, the paper's ``r = ceil(log2 s) + 1``: one sign bit plus a magnitude
``s * xi_i`` in ``0..s``, with ``s = 2^(bits-1) - 1`` (``bits = 2`` gives the
ternary ``s = 1``). The paper's "precision" ``log2 s`` of its legends (QSGD-MN 8)
is ``precision = bits - 1 = log2(s + 1)``: QSGD-MN with precision ``p`` is
``QSGDMaxNormCodec(bits=p + 1)``; the ``maxnorm`` algorithm's ``bits`` is ``p``.

Multiple scales. ``MultiScaleMaxNormCodec(scales=(2, 6))`` is the paper's
two-scale "(2, 6)": the scales are given by their precision ``p_j``,
``s_j = 2^p_j - 1``, i.e. levels ``(3, 63)``. Each coordinate uses the largest
scale ``s`` with ``s <= (W / |x_i|) * min_j s_j`` (eq. 11), so its code magnitude
never exceeds ``min_j s_j``. Workers share the scale index by MIN (scale sharing,
a second all-reduce), after which all codes of a coordinate are on the same scale
and can be summed; decoding divides element-wise by the coordinate's scale
(eq. 13). Bits per coordinate: ``min_j p_j + 1 + ceil(log2 N)``.

Layout: :mod:`.single` (:class:`QSGDMaxNormCodec`), :mod:`.multiscale`
(:class:`MultiScaleMaxNormCodec`), :mod:`.shared` (what both use: norms, checks,
the fast path's opening; the wire form, precision and fast path are described there).
"""

from .multiscale import MultiScaleMaxNormCodec
from .shared import FAMILY, NORMS, _f32_up, _norm_of, sum_squares_reference
from .single import QSGDMaxNormCodec

__all__ = ["NORMS", "QSGDMaxNormCodec", "MultiScaleMaxNormCodec", "sum_squares_reference", "FAMILY"]
