# The backend's files the extension ships (its Python modules, the share page's template and the pretrained
# appearance's weights), relative to NEURALRAYCAST_LIB_DIR: all of NeuralRaycastLib except its measurement code
# (NeuralRaycastLib/bench), which runs from a clone only.
# Included by CMakeLists.txt; `cmake -DNEURALRAYCAST_LIB_DIR=<dir> -P LibFiles.cmake` prints the list.
if(CMAKE_SCRIPT_MODE_FILE)
  file(GLOB_RECURSE NEURALRAYCAST_LIB_FILES RELATIVE ${NEURALRAYCAST_LIB_DIR} ${NEURALRAYCAST_LIB_DIR}/*.py
    ${NEURALRAYCAST_LIB_DIR}/*.html ${NEURALRAYCAST_LIB_DIR}/*.safetensors)
else()
  file(GLOB_RECURSE NEURALRAYCAST_LIB_FILES CONFIGURE_DEPENDS RELATIVE ${NEURALRAYCAST_LIB_DIR}
    ${NEURALRAYCAST_LIB_DIR}/*.py ${NEURALRAYCAST_LIB_DIR}/*.html ${NEURALRAYCAST_LIB_DIR}/*.safetensors)
endif()
list(FILTER NEURALRAYCAST_LIB_FILES EXCLUDE REGEX "(^|/)__pycache__/")
list(FILTER NEURALRAYCAST_LIB_FILES EXCLUDE REGEX "^bench/")
list(SORT NEURALRAYCAST_LIB_FILES)

if(CMAKE_SCRIPT_MODE_FILE)
  foreach(_file IN LISTS NEURALRAYCAST_LIB_FILES)
    message("${_file}")
  endforeach()
endif()
