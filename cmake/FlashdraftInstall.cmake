# `cmake --install` puts the engine, the plugin API headers and a CMake package in the
# prefix, so that a user's repository can do:
#   find_package(flashdraft REQUIRED)
#   flashdraft_add_plugin(my_kernel KIND kernel SOURCES my_kernel.cpp)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS flashdraft_core flashdraft_cli EXPORT flashdraftTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY core/include/flashdraft DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${FLASHDRAFT_PLUGIN_DIR}/ DESTINATION ${CMAKE_INSTALL_LIBDIR}/flashdraft/plugins
  FILES_MATCHING PATTERN "*.so")
install(EXPORT flashdraftTargets NAMESPACE flashdraft::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashdraft)
configure_package_config_file(cmake/flashdraftConfig.cmake.in
  ${CMAKE_BINARY_DIR}/flashdraftConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashdraft)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/flashdraftConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/flashdraftConfig.cmake
  ${CMAKE_BINARY_DIR}/flashdraftConfigVersion.cmake cmake/FlashdraftPlugin.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashdraft)
install(FILES analysis/flashdraft_logs.py analysis/plot_run.py DESTINATION ${CMAKE_INSTALL_DATADIR}/flashdraft/analysis)
