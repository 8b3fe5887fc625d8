# TileLang kernels (kernels/*.py) lowered to CUDA at build time by tools/build/tilelang_codegen.py.
#
# deepfuse_add_tilelang_kernels(<target>):
#  - configure: lists the kernels (the Python needs torch + tilelang; DEEPFUSE_CODEGEN_PYTHON,
#    default the build's Python) and TileLang's header directories;
#  - build: a custom command lowers every kernel for every arch in DEEPFUSE_CUDA_ARCHS into
#    ${CMAKE_BINARY_DIR}/tilelang_gen (reruns when kernels/*.py or the generator change);
#    each arch's files are compiled only for that arch (SASS), C++20, TileLang's flags;
#  - <target> gets the objects, the generated dispatcher and the directory of the generated
#    header deepfuse_tl_kernels.h (launchers deepfuse::tl::<kernel>(...)).
# Nothing of TileLang is needed at run time.

function(deepfuse_add_tilelang_kernels target)
  if(DEEPFUSE_CODEGEN_PYTHON)
    set(_py "${DEEPFUSE_CODEGEN_PYTHON}")
  else()
    set(_py "${Python_EXECUTABLE}")
  endif()
  set(_tool "${CMAKE_SOURCE_DIR}/tools/build/tilelang_codegen.py")
  set(_gen "${CMAKE_BINARY_DIR}/tilelang_gen")
  file(GLOB _kernels CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/kernels/*.py")
  list(FILTER _kernels EXCLUDE REGEX "/_[^/]*\\.py$")
  list(SORT _kernels)
  if(NOT _kernels)
    message(FATAL_ERROR "DEEPFUSE_TILELANG=ON but there is no kernels/*.py")
  endif()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_kernels} "${_tool}")

  # Kernel list and include dirs; rerun only when an input or the Python changed.
  set(_info "${_gen}/tilelang_info.cmake")
  set(_rerun TRUE)
  if(EXISTS "${_info}" AND "${DEEPFUSE_TL_INFO_PY}" STREQUAL "${_py}"
     AND "${DEEPFUSE_TL_INFO_INPUTS}" STREQUAL "${_kernels}")
    set(_rerun FALSE)
    foreach(f IN LISTS _kernels _tool)
      if("${f}" IS_NEWER_THAN "${_info}")
        set(_rerun TRUE)
      endif()
    endforeach()
  endif()
  if(_rerun)
    message(STATUS "deepfuse: listing TileLang kernels with ${_py}")
    execute_process(
      COMMAND "${_py}" "${_tool}" info --out "${_gen}" --kernels ${_kernels}
      RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
    if(NOT _rc EQUAL 0)
      message(FATAL_ERROR "deepfuse: TileLang code generation is unavailable (${_py}):\n${_out}${_err}\n"
        "Build with --no-build-isolation from an environment with torch and tilelang==0.1.15, "
        "set DEEPFUSE_CODEGEN_PYTHON to such a Python, or set DEEPFUSE_TILELANG=OFF.")
    endif()
    set(DEEPFUSE_TL_INFO_PY "${_py}" CACHE INTERNAL "")
    set(DEEPFUSE_TL_INFO_INPUTS "${_kernels}" CACHE INTERNAL "")
  endif()
  include("${_info}")

  set(_outputs "${_gen}/deepfuse_tl_kernels.h" "${_gen}/deepfuse_tl_dispatch.cpp")
  foreach(arch IN LISTS DEEPFUSE_CUDA_ARCHS)
    set(_srcs_${arch} "")
    foreach(k IN LISTS DEEPFUSE_TL_KERNELS)
      list(APPEND _srcs_${arch} "${_gen}/sm_${arch}/${k}.cu")
    endforeach()
    list(APPEND _outputs ${_srcs_${arch}})
  endforeach()
  string(REPLACE ";" "," _archs "${DEEPFUSE_CUDA_ARCHS}")
  add_custom_command(
    OUTPUT ${_outputs}
    COMMAND "${_py}" "${_tool}" generate --out "${_gen}" --archs "${_archs}" --kernels ${_kernels}
    DEPENDS ${_kernels} "${_tool}"
    COMMENT "Lowering TileLang kernels for ${_archs}"
    VERBATIM)
  add_custom_target(deepfuse_tl_codegen DEPENDS ${_outputs})

  foreach(arch IN LISTS DEEPFUSE_CUDA_ARCHS)
    set(_lib "deepfuse_tl_sm${arch}")
    add_library(${_lib} OBJECT ${_srcs_${arch}})
    add_dependencies(${_lib} deepfuse_tl_codegen)
    set_target_properties(${_lib} PROPERTIES
      CUDA_ARCHITECTURES "${arch}-real"
      CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
      POSITION_INDEPENDENT_CODE ON
      CUDA_SEPARABLE_COMPILATION OFF)
    target_include_directories(${_lib} SYSTEM PRIVATE "${DEEPFUSE_TL_SRC_DIR}" "${DEEPFUSE_TL_CUTLASS_DIR}")
    # TileLang's own nvcc flags (tilelang/jit/adapter/libgen.py), minus -lcuda: driver entry
    # points are fetched at run time.
    target_compile_options(${_lib} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-w -Xcudafe --diag_suppress=177 -lineinfo>)
    target_link_libraries(${target} PRIVATE ${_lib})
  endforeach()

  target_sources(${target} PRIVATE "${_gen}/deepfuse_tl_dispatch.cpp")
  target_include_directories(${target} PRIVATE "${_gen}" ${CUDAToolkit_INCLUDE_DIRS})
  add_dependencies(${target} deepfuse_tl_codegen)
endfunction()
