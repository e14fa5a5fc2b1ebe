# CUDA for flashdraft's own kernels (core/cuda, kernels/flash_cuda).
#
# flashdraft_enable_cuda(<out-var> <what>)   (a macro: it acts in the calling folder)
#   Sets <out-var> to TRUE when CUDA code can be built here - FLASHDRAFT_BUILD_CUDA is ON,
#   the LibTorch found has CUDA and a CUDA compiler exists - enables the CUDA language and
#   finds the toolkit; otherwise FALSE, with a status line saying why <what> is not built.
#   It also empties CMAKE_CUDA_FLAGS in the calling folder: LibTorch's CMake appends a
#   -gencode pair for each of its 11 architectures there, and our libraries are built for
#   the architectures they name (the list would triple nvcc's time).
#
# flashdraft_cuda_library(<name> <architectures> <sources...>)
#   A static library of .cu files for <architectures> (CUDA_ARCHITECTURES syntax), C++17,
#   position independent, hidden visibility, linked with the shared CUDA runtime (the one
#   LibTorch loads, so both see one context); its folder and core/include (for
#   flashdraft/launch.cuh) are on its include path.
macro(flashdraft_enable_cuda out what)
  set(${out} FALSE)
  if(NOT FLASHDRAFT_BUILD_CUDA)
    message(STATUS "${what}: not built (FLASHDRAFT_BUILD_CUDA=OFF)")
  elseif(NOT FLASHDRAFT_WITH_CUDA)
    message(STATUS "${what}: not built (the LibTorch found has no CUDA)")
  else()
    include(CheckLanguage)
    check_language(CUDA)
    if(NOT CMAKE_CUDA_COMPILER)
      message(STATUS "${what}: not built (no CUDA compiler found)")
    else()
      enable_language(CUDA)
      find_package(CUDAToolkit REQUIRED)
      set(CMAKE_CUDA_FLAGS "")
      set(${out} TRUE)
    endif()
  endif()
endmacro()

function(flashdraft_cuda_library name archs)
  add_library(${name} STATIC ${ARGN})
  set_target_properties(${name} PROPERTIES
    CUDA_ARCHITECTURES "${archs}"
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Shared
    POSITION_INDEPENDENT_CODE ON
    CUDA_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden)
  target_include_directories(${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
  # flashdraft/launch.cuh (header-only, CUDA runtime only; no LibTorch header reaches nvcc)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/core/include)
  target_link_libraries(${name} PUBLIC CUDA::cudart)
endfunction()
