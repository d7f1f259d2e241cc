#include "proto/printable.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <string>

#include "base/utf8.h"

namespace engram {

void MakePrintable(google::protobuf::Message* msg) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = msg->GetReflection();
  const google::protobuf::Descriptor* d = msg->GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const bool text = f->type() == FieldDescriptor::TYPE_STRING;
    const bool nested = f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    if (!text && !nested) continue;
    if (f->is_repeated()) {
      const int n = r->FieldSize(*msg, f);
      for (int j = 0; j < n; ++j) {
        if (text) {
          r->SetRepeatedString(msg, f, j, Printable(r->GetRepeatedString(*msg, f, j)));
        } else {
          MakePrintable(r->MutableRepeatedMessage(msg, f, j));
        }
      }
    } else if (r->HasField(*msg, f) || (text && !f->has_presence())) {
      if (text) {
        const std::string v = r->GetString(*msg, f);
        if (!v.empty()) r->SetString(msg, f, Printable(v));
      } else {
        MakePrintable(r->MutableMessage(msg, f));
      }
    }
  }
}

}  // namespace engram
