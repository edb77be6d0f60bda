// Protobuf messages as the C ABI's JSON dictionaries, generated from the
// message's descriptor: a new field of a stats message reaches Python with
// no change here. Unlike protobuf's JSON printer (used by the CLI), 64-bit
// integers are JSON numbers, so Python gets ints; field names are the
// proto's (snake_case). Every field is written: scalars and repeated fields
// always, an unset message field as null, an enum as its value's name.
#ifndef ACTSTASH_CLIENT_CAPI_MESSAGE_JSON_H_
#define ACTSTASH_CLIENT_CAPI_MESSAGE_JSON_H_

#include <google/protobuf/message.h>

#include "client/capi/json_writer.h"

namespace actstash::capi {

// Writes `message` as a JSON object (after a Key, in an array, or alone).
void WriteMessage(JsonWriter& w, const google::protobuf::Message& message);

}  // namespace actstash::capi

#endif  // ACTSTASH_CLIENT_CAPI_MESSAGE_JSON_H_
