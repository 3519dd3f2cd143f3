// The CUDA autocast dtype for imgrun's mixed precision (actors/src/train/precision.rs):
// tch exposes autocast's on/off switch only, and autocast computes in float16 unless told
// otherwise. ATen keeps the dtype per thread and per device type; setting it needs no GPU.
//
// Dtypes cross as small codes, not ATen's ScalarType numbers: 0 float16, 1 bfloat16,
// 2 any other (only read back).

#include <ATen/autocast_mode.h>

extern "C" {

// Sets the calling thread's CUDA autocast dtype: 0 float16, 1 bfloat16. Returns 0, or 1
// for another code or when ATen refused.
int imgrun_set_cuda_autocast_dtype(int code) {
  at::ScalarType dtype;
  switch (code) {
  case 0:
    dtype = at::kHalf;
    break;
  case 1:
    dtype = at::kBFloat16;
    break;
  default:
    return 1;
  }
  try {
    at::autocast::set_autocast_dtype(at::kCUDA, dtype);
    return 0;
  } catch (...) {
    return 1;
  }
}

// The calling thread's CUDA autocast dtype: 0 float16, 1 bfloat16, 2 another, -1 when
// ATen refused.
int imgrun_cuda_autocast_dtype() {
  try {
    switch (at::autocast::get_autocast_dtype(at::kCUDA)) {
    case at::kHalf:
      return 0;
    case at::kBFloat16:
      return 1;
    default:
      return 2;
    }
  } catch (...) {
    return -1;
  }
}
}
