/* The vector exp's polynomial, one home for both vector widths (cpu_vec.h's exp16, cpu_vec2.h's
 * exp8): 2^f for f in [-0.5, 0.5] by Horner's rule in fused multiply-adds, relative error ~1e-7.
 * ``set1`` and ``fmadd`` are the width's intrinsics. */
#ifndef TRAE_CPU_EXP2_H
#define TRAE_CPU_EXP2_H

#define EXP2_POLY(set1, fmadd, f)                                                                  \
    fmadd(fmadd(fmadd(fmadd(fmadd(fmadd(set1(1.540353039338161e-4f), f,                           \
                                        set1(1.333355814642844e-3f)),                             \
                                  f, set1(9.618129107628477e-3f)),                                \
                            f, set1(5.550410866482158e-2f)),                                      \
                      f, set1(2.402265069591007e-1f)),                                            \
                f, set1(6.931471805599453e-1f)),                                                  \
          f, set1(1.0f))

#endif
