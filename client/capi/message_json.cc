#include "client/capi/message_json.h"

#include <google/protobuf/descriptor.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace actstash::capi {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// Element `index` of a repeated field, or the singular field when index < 0.
void WriteValue(JsonWriter& w, const Message& m, const FieldDescriptor* f, int index) {
  const Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      w.RawValue(absl::StrCat(rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      w.RawValue(absl::StrCat(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      w.RawValue(absl::StrCat(rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      w.RawValue(absl::StrCat(rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      w.RawValue(absl::StrCat(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      w.RawValue(absl::StrCat(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f)));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      w.RawValue((rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f)) ? "true" : "false");
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      w.StringValue((rep ? r->GetRepeatedEnum(m, f, index) : r->GetEnum(m, f))->name());
      break;
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string scratch;
      w.StringValue(rep ? r->GetRepeatedStringReference(m, f, index, &scratch)
                        : r->GetStringReference(m, f, &scratch));
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      WriteMessage(w, rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
      break;
  }
}

}  // namespace

void WriteMessage(JsonWriter& w, const Message& message) {
  const Reflection* r = message.GetReflection();
  const google::protobuf::Descriptor* d = message.GetDescriptor();
  w.Begin();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    w.Key(f->name());
    if (f->is_repeated()) {
      w.BeginArray();
      for (int j = 0; j < r->FieldSize(message, f); ++j) WriteValue(w, message, f, j);
      w.EndArray();
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && !r->HasField(message, f)) {
      w.RawValue("null");
    } else {
      WriteValue(w, message, f, -1);
    }
  }
  w.End();
}

}  // namespace actstash::capi
