// Declarations for ProcessGroupGloo.hpp (see ../README.md): nothing of it is used.
#pragma once
