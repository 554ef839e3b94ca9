package authz

// A call that enters at one agent and runs at another (a write forwarded
// to the leader, a backend call routed to the node that holds the object,
// a restore relayed to the leader) carries its caller's own credential to
// the agent that runs it, which authenticates it again and applies its
// RBAC policy itself (gateway/access: Relayed): the relaying agent's
// certificate proves only which node relays, never who the caller is.
const (
	// CallerTokenHeader is the caller's bearer token.
	CallerTokenHeader = "pivirt-caller-token"
	// CallerCertHeader is the caller's client certificate chain, one
	// value per certificate (DER, standard base64), leaf first.
	CallerCertHeader = "pivirt-caller-cert"
	// CallerMethodHeader is the method the caller called at the agent it
	// reached first.
	CallerMethodHeader = "pivirt-caller-method"
)

// RelayHeaders are the headers of a relayed caller: set for the calls an
// agent relays to another, never passed on from a client.
var RelayHeaders = []string{CallerTokenHeader, CallerCertHeader, CallerMethodHeader}
