# Precompiled headers. <ATen/ATen.h> (every operator's declaration) is about 8 of the ~10 s that gcc
# spends on one of our translation units; a target that precompiles it once (~25 s) then compiles
# each file in ~2.5 s. Worth it for the targets of many files that include ATen's headers: the
# library, the runner and the test binary (scripts/test.sh builds them in several trees); not
# for kvpress-cli (tools/CMakeLists.txt: measured slower with one). Targets add the other
# heavy headers most of their files include (GoogleTest, nlohmann/json, fmt). The headers are
# force-included in C++ files only: the .cu files include no ATen (src/ops/<family>/cuda/<op>_bridge.cpp
# holds each CUDA op's ATen side).
# KVPRESS_PCH=OFF compiles every file on its own includes, as a user's build of one file would.
option(KVPRESS_PCH "Precompile the ATen headers of the library, runner, CLI and test targets" ON)

# kvpress_precompile_aten(target [header ...]): ATen's headers and the extra <header>s.
function(kvpress_precompile_aten target)
  if(NOT KVPRESS_PCH)
    return()
  endif()
  set(headers "$<$<COMPILE_LANGUAGE:CXX>:<ATen/ATen.h$<ANGLE-R>>"
              "$<$<COMPILE_LANGUAGE:CXX>:<ATen/Parallel.h$<ANGLE-R>>"
              "$<$<COMPILE_LANGUAGE:CXX>:<torch/library.h$<ANGLE-R>>")
  foreach(header IN LISTS ARGN)
    list(APPEND headers "$<$<COMPILE_LANGUAGE:CXX>:<${header}$<ANGLE-R>>")
  endforeach()
  target_precompile_headers(${target} PRIVATE ${headers})
endfunction()

# kvpress_share_precompiled_aten(target ...): single-file executables (benchmarks, examples) take
# one shared precompiled ATen header instead of parsing ATen each (about 12 s a file), from an
# object library built with the flags an executable of the project gets.
function(kvpress_share_precompiled_aten)
  if(NOT KVPRESS_PCH)
    return()
  endif()
  if(NOT TARGET kvpress_shared_aten_pch)
    file(WRITE ${PROJECT_BINARY_DIR}/kvpress_shared_aten_pch.cpp "// precompiled ATen headers only\n")
    add_library(kvpress_shared_aten_pch OBJECT ${PROJECT_BINARY_DIR}/kvpress_shared_aten_pch.cpp)
    target_link_libraries(kvpress_shared_aten_pch PRIVATE kvpress::kvpress)
    kvpress_precompile_aten(kvpress_shared_aten_pch)
  endif()
  foreach(target IN LISTS ARGN)
    target_precompile_headers(${target} REUSE_FROM kvpress_shared_aten_pch)
  endforeach()
endfunction()
