// Checked errors. Every failure a user can cause throws mt::Error with a message that
// says what is wrong and what to change; the command catches it, prints it and exits 1.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace mt {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A start-up verdict every rank of the job throws, with the same message (train()'s checks
// agree on it before any work): the command prints it once and exits 1, no rank is aborted.
struct AgreedError : Error {
  using Error::Error;
};

// MT_CHECK(cond, "what" << value << "; fix") throws mt::Error when cond is false.
#define MT_CHECK(cond, msg)                      \
  do {                                           \
    if (!(cond)) {                               \
      std::ostringstream mt_check_os_;           \
      mt_check_os_ << msg;                       \
      throw ::mt::Error(mt_check_os_.str());     \
    }                                            \
  } while (0)

#define MT_FAIL(msg) MT_CHECK(false, msg)

}  // namespace mt
