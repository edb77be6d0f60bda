// The C ABI's settings by name: ClientOptions and EngineOptions read from a
// JSON object and written back as one (their defaults, for
// actstash_describe_json). One table per options struct, so the names a
// front-end may pass and the defaults it can read come from the same rows,
// and a default is written once: in the struct's member initializer.
//
// Thread-safety: free functions over their arguments; the tables are
// immutable.
#ifndef ACTSTASH_CLIENT_CAPI_OPTIONS_JSON_H_
#define ACTSTASH_CLIENT_CAPI_OPTIONS_JSON_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "actstash/saved_tensors.h"
#include "client/capi/json_writer.h"

namespace actstash::capi {

// What actstash_engine_create configures: the engine and the host copy
// engine it creates (copy_delay_us and seed are the latter's).
struct EngineSettings {
  EngineOptions engine;
  HostCopyEngineOptions host;
};

// Sets the members named in `json` (an object; empty or "{}": none) and
// leaves the others as they are. Names are the rows of the tables in
// options_json.cc; sizes take a number of bytes or a size string
// ("512MiB", "1.5GB": ParseByteSize), durations are whole milliseconds
// (names ending in _ms), choices are strings. INVALID_ARGUMENT, naming the
// setting, for malformed JSON, an unknown name, a wrong type, a fraction
// where a whole number belongs, or a value out of range; `options` may then
// be partly set.
absl::Status ReadClientOptions(absl::string_view json, ClientOptions& options);
absl::Status ReadEngineSettings(absl::string_view json, EngineSettings& settings);

// Every row as "name": value, inside the object the writer has open.
void WriteClientOptions(JsonWriter& w, const ClientOptions& options);
void WriteEngineSettings(JsonWriter& w, const EngineSettings& settings);

}  // namespace actstash::capi

#endif  // ACTSTASH_CLIENT_CAPI_OPTIONS_JSON_H_
