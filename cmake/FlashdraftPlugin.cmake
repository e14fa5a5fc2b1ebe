# flashdraft_add_plugin(<target> KIND <kind> SOURCES <files...>
#                       [LIBRARIES <libs...>] [OUTPUT_DIRECTORY <dir>] [NO_PCH])
# Builds a plugin shared library against the flashdraft engine: hidden visibility
# (only the entry point is exported), the engine's build fingerprint, LibTorch.
# Used in-tree and, through the installed CMake package, by out-of-tree plugins.
# The kinds are the rows of flashdraft/plugin_kinds.def (the engine's one table of kinds).

# Kind names from plugin_kinds.def, found in the source tree or the installed headers.
function(_flashdraft_plugin_kinds out)
  foreach(dir ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../core/include
              ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../../../include)
    if(EXISTS ${dir}/flashdraft/plugin_kinds.def)
      file(STRINGS ${dir}/flashdraft/plugin_kinds.def rows REGEX "^FLASHDRAFT_PLUGIN_KIND\\(")
      set(kinds "")
      foreach(row ${rows})
        string(REGEX REPLACE "^FLASHDRAFT_PLUGIN_KIND\\([0-9]+, *([a-z_]+),.*" "\\1" kind "${row}")
        list(APPEND kinds ${kind})
      endforeach()
      set(${out} ${kinds} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "flashdraft: flashdraft/plugin_kinds.def not found next to ${CMAKE_CURRENT_FUNCTION_LIST_DIR}")
endfunction()

function(flashdraft_add_plugin target)
  cmake_parse_arguments(P "NO_PCH" "KIND;OUTPUT_DIRECTORY" "SOURCES;LIBRARIES" ${ARGN})
  _flashdraft_plugin_kinds(kinds)
  if(NOT P_KIND IN_LIST kinds)
    string(REPLACE ";" ", " kinds_text "${kinds}")
    message(FATAL_ERROR "flashdraft_add_plugin(${target}): KIND '${P_KIND}' is not one of ${kinds_text} (flashdraft/plugin_kinds.def)")
  endif()
  if(NOT P_SOURCES)
    message(FATAL_ERROR "flashdraft_add_plugin(${target}): no SOURCES given")
  endif()
  add_library(${target} MODULE ${P_SOURCES})
  target_link_libraries(${target} PRIVATE flashdraft::core ${P_LIBRARIES})
  set_target_properties(${target} PROPERTIES
    PREFIX "lib"
    OUTPUT_NAME "flashdraft-${P_KIND}-${target}"
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  if(P_OUTPUT_DIRECTORY)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${P_OUTPUT_DIRECTORY})
  elseif(DEFINED FLASHDRAFT_PLUGIN_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${FLASHDRAFT_PLUGIN_DIR})
  endif()
  # In the flashdraft tree, plugins get the project's warnings (errors in CI) and
  # `flashdraft_all_plugins` builds every plugin.
  if(TARGET flashdraft_warnings)
    target_link_libraries(${target} PRIVATE flashdraft_warnings)
  endif()
  if(TARGET flashdraft_all_plugins)
    add_dependencies(flashdraft_all_plugins ${target})
  endif()
  if(TARGET flashdraft_pch AND NOT P_NO_PCH)
    target_precompile_headers(${target} REUSE_FROM flashdraft_pch)
  endif()
endfunction()

# flashdraft_add_plugin_library(<target> SOURCES <files...> [LIBRARIES <libs...>]
#                               [PRIVATE_LIBRARIES <libs...>])
# A static library of a plugin's parts that tests and other plugins link too (a drafter's
# serving format, the base of a drafter family): hidden symbols like the plugin's (-fPIC, so
# a plugin can link it), flashdraft::core and LIBRARIES public, its folder on the include path.
function(flashdraft_add_plugin_library target)
  cmake_parse_arguments(P "" "" "SOURCES;LIBRARIES;PRIVATE_LIBRARIES" ${ARGN})
  if(NOT P_SOURCES)
    message(FATAL_ERROR "flashdraft_add_plugin_library(${target}): no SOURCES given")
  endif()
  add_library(${target} STATIC ${P_SOURCES})
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_link_libraries(${target} PUBLIC flashdraft::core ${P_LIBRARIES} PRIVATE ${P_PRIVATE_LIBRARIES})
  if(TARGET flashdraft_warnings)
    target_link_libraries(${target} PRIVATE flashdraft_warnings)
  endif()
  target_include_directories(${target} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
  flashdraft_use_pch(${target})
endfunction()

# flashdraft_use_pch(<executable>): reuse the precompiled LibTorch header in an
# executable. The PCH is compiled as position-independent library code (-fPIC), so
# the executable's objects must be too (not -fPIE).
function(flashdraft_use_pch target)
  if(TARGET flashdraft_pch)
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${target} PRIVATE -fPIC)
    target_precompile_headers(${target} REUSE_FROM flashdraft_pch)
  endif()
endfunction()

# flashdraft_add_plugin_folders(): every child folder of the current source folder that
# has a CMakeLists.txt is added (one plugin, or a folder of plugins), in name order.
macro(flashdraft_add_plugin_folders)
  file(GLOB _flashdraft_children LIST_DIRECTORIES true RELATIVE ${CMAKE_CURRENT_SOURCE_DIR}
    ${CMAKE_CURRENT_SOURCE_DIR}/*)
  list(SORT _flashdraft_children)
  foreach(_flashdraft_child ${_flashdraft_children})
    if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${_flashdraft_child}/CMakeLists.txt)
      add_subdirectory(${_flashdraft_child})
    endif()
  endforeach()
endmacro()
