# cmake -DFILE=<ELF file> -DRPATH=<new RPATH> -P set_rpath.cmake: replaces the file's RPATH/RUNPATH
# (python/CMakeLists.txt, for a prebuilt libkvpress.so). Fails when the file has none, or when the
# new one is longer than the old (CMake edits the ELF in place).
file(RPATH_SET FILE "${FILE}" NEW_RPATH "${RPATH}")
