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

# Standalone driver of the grouped FP8 GEMM (not installed): CUTLASS configurations timed
# side by side on the same inputs (csrc/tools/moe_driver.cu). JAX_DSPARK_MOE_PROBES adds the
# alternative configurations to its own compile of grouped_gemm_fp8.cu only.
if(JAX_DSPARK_BUILD_DRIVER)
  add_executable(moe_driver csrc/tools/moe_driver.cu csrc/moe/grouped_gemm.cu csrc/moe/grouped_gemm_fp8.cu)
  set_target_properties(moe_driver PROPERTIES CUDA_STANDARD 17)
  target_include_directories(moe_driver PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/csrc"
    "${JAX_DSPARK_CUTLASS_DIR}/include" "${JAX_DSPARK_CUTLASS_DIR}/tools/util/include")
  target_compile_options(moe_driver PRIVATE ${_jds_gencode} -O3 --expt-relaxed-constexpr)
  target_compile_definitions(moe_driver PRIVATE JAX_DSPARK_MOE_PROBES NDEBUG)
  target_link_libraries(moe_driver PRIVATE CUDA::cudart_static)
endif()
