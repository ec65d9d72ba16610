// The checks of the plain C++ tests in this folder: EXPECT(cond) prints what failed and counts it; a test's main
// returns finish(name), the number of failed checks (its exit status, capped at 255).
#pragma once

#include <cstdio>

namespace moe_test {

inline int failures = 0;

inline int finish(const char* name) {
  std::printf("%s: %d failed checks\n", name, failures);
  return failures > 255 ? 255 : failures;
}

}  // namespace moe_test

#define EXPECT(cond)                                                  \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);    \
      ++moe_test::failures;                                           \
    }                                                                 \
  } while (0)
