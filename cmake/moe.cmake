# Mixture-of-experts kernels (csrc/moe/, ffi/moe_handlers.cc), added to the kernel library's
# objects. Included by CMakeLists.txt after cmake/kernels.cmake; does nothing when that file
# built no library (no CUDA compiler or no FFI headers).
#
# The grouped GEMM is CUTLASS 3.x: its headers come from the `nvidia-cutlass` wheel at build
# time (never vendored). JAX_DSPARK_CUTLASS_DIR may point at a CUTLASS tree holding
# include/cutlass/cutlass.h; by default the build's Python finds `cutlass_library` and uses
# <cutlass_library>/source. Without CUTLASS the MoE kernels are left out (the ops then run
# their references) unless JAX_DSPARK_CUDA=ON, which makes a missing CUTLASS an error.

if(NOT TARGET jax_dspark_objs)
  return()
endif()

set(JAX_DSPARK_CUTLASS_DIR "" CACHE PATH "CUTLASS source tree (default: the nvidia-cutlass wheel of the build's Python)")
if(NOT JAX_DSPARK_CUTLASS_DIR)
  jax_dspark_package_dir(cutlass_library source JAX_DSPARK_CUTLASS_DIR)
endif()
if(NOT EXISTS "${JAX_DSPARK_CUTLASS_DIR}/include/cutlass/cutlass.h")
  if(JAX_DSPARK_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jax_dspark: CUTLASS headers not found (pip install nvidia-cutlass, or set JAX_DSPARK_CUTLASS_DIR)")
  endif()
  message(WARNING "jax_dspark: no CUTLASS headers (nvidia-cutlass wheel); MoE kernels not built")
  return()
endif()
message(STATUS "jax_dspark: CUTLASS ${JAX_DSPARK_CUTLASS_DIR}")

target_sources(jax_dspark_objs PRIVATE
  csrc/moe/route.cu
  csrc/moe/experts.cu
  csrc/moe/grouped_gemm.cu
  csrc/moe/experts_fp8.cu
  csrc/moe/grouped_gemm_fp8.cu
  ffi/moe_handlers.cc)
# Only the grouped GEMMs see CUTLASS (keeps the other files' compile fast and warning-free).
set_source_files_properties(csrc/moe/grouped_gemm.cu csrc/moe/grouped_gemm_fp8.cu PROPERTIES
  INCLUDE_DIRECTORIES "${JAX_DSPARK_CUTLASS_DIR}/include;${JAX_DSPARK_CUTLASS_DIR}/tools/util/include"
  COMPILE_DEFINITIONS "NDEBUG")
# registry.cc and module.cc list the MoE targets only when they are built.
target_compile_definitions(jax_dspark_objs PRIVATE JAX_DSPARK_WITH_MOE=1)
if(TARGET _C)
  target_compile_definitions(_C PRIVATE JAX_DSPARK_WITH_MOE=1)
endif()
