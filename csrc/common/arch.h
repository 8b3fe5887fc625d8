// Which device passes compile the Hopper-only kernels (wgmma: grouped_gemm_sm90.cuh).
// DEEPFUSE_SM90A_DEVICE is 1 in the host pass and the sm_90a device pass, 0 in every other
// device pass (sm_100a, ...). A Hopper-only kernel keeps its body under it and traps
// elsewhere; its launcher calls require_sm90a first, and deepfuse/_ext.py (_SM90A_ONLY)
// raises before the launcher is reached, so the trap body never runs.
#pragma once

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DEEPFUSE_SM90A_DEVICE 1
#else
#define DEEPFUSE_SM90A_DEVICE 0
#endif
