# Precompiled ATen headers. <ATen/ATen.h> (every operator's declaration) is about 8 of the ~10 s
# that gcc spends on one of our translation units; a target that precompiles it once (~25 s) then
# compiles each file in ~2.5 s. Worth it for the targets of many files: the library, the runner,
# kvpress-cli and the test binary (scripts/test.sh builds five trees of them). The header is
# force-included in C++ files only (nvcc compiles the .cu files as before).
# KVPRESS_PCH=OFF compiles every file on its own includes, as a user's build of one file would.
option(KVPRESS_PCH "Precompile the ATen headers of the library, runner, CLI and test targets" ON)

function(kvpress_precompile_aten target)
  if(KVPRESS_PCH)
    target_precompile_headers(${target} PRIVATE
      "$<$<COMPILE_LANGUAGE:CXX>:<ATen/ATen.h$<ANGLE-R>>"
      "$<$<COMPILE_LANGUAGE:CXX>:<ATen/Parallel.h$<ANGLE-R>>"
      "$<$<COMPILE_LANGUAGE:CXX>:<torch/library.h$<ANGLE-R>>")
  endif()
endfunction()
