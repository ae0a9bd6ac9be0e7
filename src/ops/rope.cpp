// Rotary position embedding (Hugging Face rotate-half convention), in place.
//
// The angles follow Hugging Face's float32 computation exactly, so a PyTorch reference
// matches to rounding:  inv_freq[i] = 1 / theta^((2i) / D)  (float32 pow and divide),
// angle = float(t) * inv_freq[i] (float32), cos/sin in float32.
#include "ops/rope.h"

#include <cmath>
#include <vector>

#include "core/profile.h"
#include "ops/cuda/ops.h"
#include "ops/detail.h"

namespace mt {

using namespace detail;

namespace {

// sign = +1: forward rotation; sign = -1: the inverse (transpose) rotation.
void rope_apply(const Tensor& x, int n_rot, float theta, const int32_t* pos, float sign, const char* op) {
  check_f32(x, op);
  MT_CHECK(x.ndim() == 4, op << ": x must be 4-D [B, T, H, D] (reshape the fused qkv buffer), got "
                             << shape_str(x.shape()));
  const int64_t B = x.dim(0), T = x.dim(1), H = x.dim(2), D = x.dim(3);
  MT_CHECK(D % 2 == 0 && D > 0, op << ": head dim D = " << D << " must be even");
  MT_CHECK(n_rot >= 0 && n_rot <= H, op << ": n_rot = " << n_rot << " must be in [0, H = " << H << "]");
  MT_CHECK(theta > 0.0f, op << ": rope_theta = " << theta << " must be positive");
  if (B * T == 0 || n_rot == 0) return;
  const int64_t half = D / 2;
  std::vector<float> cs(T * half), sn(T * half);
  float* xp = x.f32();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float inv_freq = 1.0f / std::pow(theta, (float)(2 * i) / (float)D);
        const float ang = (float)(pos ? pos[t] : t) * inv_freq;
        cs[t * half + i] = std::cos(ang);
        sn[t * half + i] = sign * std::sin(ang);
      }
    }
    // Implicit barrier: the table is complete before any row uses it.
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const float* c = cs.data() + (bt % T) * half;
      const float* s = sn.data() + (bt % T) * half;
      float* row = xp + bt * H * D;
      for (int64_t h = 0; h < n_rot; ++h) {
        float* x1 = row + h * D;
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  }
}

}  // namespace

void rope_forward(const Tensor& x, int n_rot, float theta, const int32_t* pos) {
  ProfileScope profile_scope("rope");
  MT_ON_CUDA(x, rope_forward(x, n_rot, theta, pos));
  rope_apply(x, n_rot, theta, pos, 1.0f, "rope_forward");
}

// The rotation by -angle is the transpose of the rotation by +angle.
void rope_backward(const Tensor& dx, int n_rot, float theta, const int32_t* pos) {
  ProfileScope profile_scope("rope_backward");
  MT_ON_CUDA(dx, rope_backward(dx, n_rot, theta, pos));
  rope_apply(dx, n_rot, theta, pos, -1.0f, "rope_backward");
}

}  // namespace mt
