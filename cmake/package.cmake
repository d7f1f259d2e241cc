# The installed development package (component `engram_dev`): the public headers of include/engram (version.h
# included), libengram_c.so, and a CMake package config so that a consumer's find_package(engram) works
# (cmake/engramConfig.cmake.in says what it gives). The shared library is the one installed library: it carries the
# client and everything it links statically (gRPC's stubs, the tables, the kernels), so a consumer links one file
# and no internal target; the static archives stay build-tree artefacts. Versioned SameMinorVersion: before 1.0 a
# minor release may change the C++ API (the C ABI has ENGRAM_ABI_VERSION for that).
include(CMakePackageConfigHelpers)
set(ENGRAM_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/engram)

install(TARGETS engram_c EXPORT engramTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT engram_dev
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The C++ API: the same library, the headers' requirements (C++20, abseil's status types) on the consumer's side.
add_library(engram_client_api INTERFACE)
set_target_properties(engram_client_api PROPERTIES EXPORT_NAME client)
target_link_libraries(engram_client_api INTERFACE engram_c absl::status absl::statusor)
target_compile_features(engram_client_api INTERFACE cxx_std_20)
target_include_directories(engram_client_api INTERFACE $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
install(TARGETS engram_client_api EXPORT engramTargets COMPONENT engram_dev)
install(EXPORT engramTargets NAMESPACE engram:: DESTINATION ${ENGRAM_CMAKE_DIR} COMPONENT engram_dev)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/engramConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/engramConfig.cmake INSTALL_DESTINATION ${ENGRAM_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/engramConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/engramConfig.cmake ${PROJECT_BINARY_DIR}/cmake/engramConfigVersion.cmake
  DESTINATION ${ENGRAM_CMAKE_DIR} COMPONENT engram_dev)
