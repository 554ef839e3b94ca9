package agent

import (
	"fmt"
	"strings"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/docgen"
	"pilab.hu/pivirt-agent/gateway"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
)

// TestDocsAPIReference: docs/api.md is the reference of the services the
// API port serves (apiDescriptors, with their authorization) and of the
// PiTrust CA server's, with the comments of their .proto files (make docs
// rewrites it).
func TestDocsAPIReference(t *testing.T) {
	page, err := docgen.APIReference("../../../proto",
		docgen.APISection{Title: "Agent API port", Intro: apiPortIntro(), Services: apiDescriptors(), RBAC: true, ByResource: accessTable(t)},
		docgen.APISection{Title: "PiTrust CA server", Intro: caServerIntro,
			Services: []protoreflect.ServiceDescriptor{pitrustv1.File_pivirt_pitrust_v1_pitrust_proto.Services().ByName("CertificateService")}},
	)
	if err != nil {
		t.Fatal(err)
	}
	if err := docgen.CheckFile("../../../docs/api.md", page); err != nil {
		t.Error(err)
	}
}

// apiPortIntro introduces the API port's services; the keys guarded as
// their own resource are configResource's.
func apiPortIntro() string {
	keys := make([]string, len(gateway.SecurityKeys))
	for i, k := range gateway.SecurityKeys {
		keys[i] = "`" + k + "`"
	}
	return fmt.Sprintf(`Every agent serves these on its API port (`+"`server.connectrpc.addr`"+`, %s by
default) over Connect, gRPC and gRPC-Web; it proxies the VM, storage and network APIs to its
node's backends and handles the others itself. **RBAC** is the resource and verb that the
policy (`+"`auth.rbac_policy`"+`) must grant one of the caller's roles; *self*: any authenticated
caller, since the method answers about the caller only. SetConfig and DeleteConfig of the keys
that decide who may do what (%s) need %s and %s on `+"`%s`"+` instead of on `+"`config`"+`.
`, "`"+config.Default().Server.ConnectRPC.Addr+"`", strings.Join(keys, ", "), "`update`", "`delete`", RBACResource)
}

const caServerIntro = `pitrust serve serves this over TLS on its ` + "`server.addr`" + `, with the OCSP responder and the CRL
as plain HTTP on the same port. Who may call a method is in its description: an operator whose
client certificate has the pitrust-admin role, the holder of a bootstrap token, or the holder
of the certificate to renew.
`
