# CUDA kernel library (included by CMakeLists.txt once a CUDA compiler was found).
#
# Builds ffi/ + csrc/ for sm_90a twice over one set of objects:
#   jax_dspark/_C.<abi>.so          pybind11 module handing the handler capsules to Python
#   jax_dspark/libjax_dspark_ffi.so  plain shared library (no Python ABI) that ctypes loads,
#                                    so one build also serves other Python versions.
# XLA FFI headers are NOT vendored: they come from the jaxlib the build sees
# (jax.ffi.include_dir() == <jaxlib>/include). Build against the OLDEST supported jaxlib:
# a handler reports the FFI API version of its headers and XLA accepts older versions only
# (docs/kernels.md, "FFI API version rule").

set(JAX_DSPARK_GENCODE "-gencode=arch=compute_90a,code=sm_90a" CACHE STRING "nvcc target flags")
set(JAX_DSPARK_XLA_FFI_INCLUDE "" CACHE PATH "directory holding xla/ffi/api/ffi.h (default: the build's jaxlib)")

find_package(Python 3.11 REQUIRED COMPONENTS Interpreter)

# <directory of the installed Python package PACKAGE>/SUBDIR, or "" when it is not installed.
# find_spec does not import the package (no side effects, works without a GPU).
function(jax_dspark_package_dir package subdir out)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import importlib.util, os; s = importlib.util.find_spec('${package}'); print(os.path.join(list(s.submodule_search_locations)[0], '${subdir}') if s else '')"
    OUTPUT_VARIABLE _dir
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  set(${out} "${_dir}" PARENT_SCOPE)
endfunction()

if(NOT JAX_DSPARK_XLA_FFI_INCLUDE)
  jax_dspark_package_dir(jaxlib include JAX_DSPARK_XLA_FFI_INCLUDE)
endif()
if(NOT EXISTS "${JAX_DSPARK_XLA_FFI_INCLUDE}/xla/ffi/api/ffi.h")
  if(JAX_DSPARK_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jax_dspark: XLA FFI headers not found (install jaxlib in the build environment)")
  endif()
  message(WARNING "jax_dspark: no XLA FFI headers (jaxlib) in the build environment; installing pure Python")
  return()
endif()
file(STRINGS "${JAX_DSPARK_XLA_FFI_INCLUDE}/xla/ffi/api/c_api.h" _minor REGEX "^#define XLA_FFI_API_MINOR")
message(STATUS "jax_dspark: XLA FFI headers ${JAX_DSPARK_XLA_FFI_INCLUDE} (${_minor})")

set(CMAKE_CUDA_ARCHITECTURES OFF)  # sm_90a needs the explicit -gencode form
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
separate_arguments(_jds_gencode UNIX_COMMAND "${JAX_DSPARK_GENCODE}")

add_library(jax_dspark_objs OBJECT
  csrc/attention/sparse_sink_attention.cu
  csrc/attention/sparse_sink_attention_wgmma.cu
  csrc/prep/rms_norm_rope.cu
  ffi/attention.cc
  ffi/prep.cc
  ffi/registry.cc)
set_target_properties(jax_dspark_objs PROPERTIES
  POSITION_INDEPENDENT_CODE ON CXX_STANDARD 17 CUDA_STANDARD 17)
set(JAX_DSPARK_MBAR_TIMEOUT_CYCLES "" CACHE STRING
    "diagnostic build: mbarrier waits trap after this many cycles (empty = wait forever, the release form)")
if(JAX_DSPARK_MBAR_TIMEOUT_CYCLES)
  target_compile_definitions(jax_dspark_objs PRIVATE JDS_MBAR_TIMEOUT_CYCLES=${JAX_DSPARK_MBAR_TIMEOUT_CYCLES})
endif()
target_include_directories(jax_dspark_objs PRIVATE
  "${CMAKE_CURRENT_SOURCE_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}/csrc")
target_include_directories(jax_dspark_objs SYSTEM PRIVATE
  "${JAX_DSPARK_XLA_FFI_INCLUDE}" ${CUDAToolkit_INCLUDE_DIRS})
target_compile_options(jax_dspark_objs PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${_jds_gencode} -O3 --expt-relaxed-constexpr>)

# ctypes library: default visibility so the extern "C" handler symbols stay exported.
add_library(jax_dspark_ffi SHARED $<TARGET_OBJECTS:jax_dspark_objs>)
target_link_libraries(jax_dspark_ffi PRIVATE CUDA::cudart_static)
target_link_options(jax_dspark_ffi PRIVATE -Wl,--no-undefined)
install(TARGETS jax_dspark_ffi LIBRARY DESTINATION jax_dspark)

# pybind11 module (optional: without pybind11 the ctypes library alone serves Python).
find_package(Python 3.11 COMPONENTS Interpreter Development.Module)
find_package(pybind11 CONFIG QUIET)
if(NOT pybind11_FOUND)
  execute_process(COMMAND "${Python_EXECUTABLE}" -m pybind11 --cmakedir
                  OUTPUT_VARIABLE _pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_pybind11_dir)
    find_package(pybind11 CONFIG QUIET PATHS "${_pybind11_dir}" NO_DEFAULT_PATH)
  endif()
endif()
if(pybind11_FOUND AND Python_Development.Module_FOUND)
  pybind11_add_module(_C MODULE ffi/module.cc $<TARGET_OBJECTS:jax_dspark_objs>)
  target_include_directories(_C PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  target_include_directories(_C SYSTEM PRIVATE "${JAX_DSPARK_XLA_FFI_INCLUDE}")
  target_link_libraries(_C PRIVATE CUDA::cudart_static)
  install(TARGETS _C LIBRARY DESTINATION jax_dspark)
else()
  message(STATUS "jax_dspark: pybind11 not found; building the ctypes library only")
endif()

# Standalone driver (not installed): memcheck edge cases and CUDA-event timing without XLA.
#   cmake -DJAX_DSPARK_BUILD_DRIVER=ON ... && ninja kernel_driver
#   compute-sanitizer --tool memcheck ./kernel_driver ; ./kernel_driver bench ["case name"]
option(JAX_DSPARK_BUILD_DRIVER "build csrc/tools/kernel_driver" OFF)
if(JAX_DSPARK_BUILD_DRIVER)
  add_executable(kernel_driver csrc/tools/kernel_driver.cu csrc/attention/sparse_sink_attention.cu
                               csrc/attention/sparse_sink_attention_wgmma.cu csrc/prep/rms_norm_rope.cu)
  set_target_properties(kernel_driver PROPERTIES CUDA_STANDARD 17)
  target_include_directories(kernel_driver PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/csrc")
  target_compile_options(kernel_driver PRIVATE ${_jds_gencode} -O3)
  # diagnostic launches (AttnProbe in attention/params.h): never compiled into the library
  target_compile_definitions(kernel_driver PRIVATE JAX_DSPARK_ATTENTION_PROBES)
  # per-CTA phase timestamps (set_attention_timeline, kernel_driver --timeline): a build of its
  # own, since the marks add stores to every attention kernel
  option(JAX_DSPARK_ATTENTION_TIMELINE "kernel_driver: record per-CTA attention timelines" OFF)
  if(JAX_DSPARK_ATTENTION_TIMELINE)
    target_compile_definitions(kernel_driver PRIVATE JAX_DSPARK_ATTENTION_TIMELINE)
  endif()
  target_link_libraries(kernel_driver PRIVATE CUDA::cudart_static)
endif()
