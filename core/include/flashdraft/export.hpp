// FLASHDRAFT_API marks what the engine library exports. Everything is compiled with
// hidden visibility; classes whose type information crosses library boundaries
// (interfaces, exceptions) carry the mark so that plugins and engine share it.
#pragma once
#define FLASHDRAFT_API __attribute__((visibility("default")))
