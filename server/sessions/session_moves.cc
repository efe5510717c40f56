#include "sessions/session_moves.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attn {

absl::Status SessionMovingError(const std::string& id) {
  return absl::UnavailableError(absl::StrCat("session ", id,
                                             " is being moved to another replica (",
                                             kMovingMarker, "); nothing was applied, retry"));
}

absl::Status SessionMovedError(const std::string& id, const std::string& address,
                               const std::string& new_id) {
  if (address.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id, " moved to this replica as ", new_id,
                     "; send its calls with that id (", kMovedToKey, ": ;", new_id, ")"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("session ", id, " moved to replica at ", address, " as ", new_id,
                   "; send its calls there (", kMovedToKey, ": ", address, ";", new_id, ")"));
}

std::string MovedToOf(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kFailedPrecondition) return "";
  const absl::string_view m = status.message();
  const std::string key = absl::StrCat(kMovedToKey, ": ");
  const size_t at = m.rfind(key);
  if (at == absl::string_view::npos) return "";
  absl::string_view rest = m.substr(at + key.size());
  const size_t end = rest.find(')');
  return std::string(end == absl::string_view::npos ? rest : rest.substr(0, end));
}

}  // namespace attn
