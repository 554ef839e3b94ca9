package agent

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/leader"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/mesh"
	"pilab.hu/pivirt-agent/gateway/netpolicy"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/schedule/v1/schedulev1connect"
	"pilab.hu/pivirt-agent/scheduler"
)

// RBACPolicyKey is the cluster config key holding a cluster-wide RBAC
// policy (the text of an rbac.yaml): when set, every agent enforces it in
// place of its auth.rbac_policy file.
const RBACPolicyKey = gateway.RBACPolicyKey

// policyWatchInterval is how often the auth.rbac_policy file is checked
// for changes.
const policyWatchInterval = 5 * time.Second

// apiDescriptors are the services of the API port that carry
// authorization annotations: the agent's own and the routed backend APIs.
func apiDescriptors() []protoreflect.ServiceDescriptor {
	return append([]protoreflect.ServiceDescriptor{
		clusterv1.File_pivirt_cluster_v1_cluster_proto.Services().ByName("ClusterService"),
		clusterv1.File_pivirt_cluster_v1_snapshot_proto.Services().ByName("SnapshotService"),
		schedulev1.File_pivirt_schedule_v1_service_proto.Services().ByName("ScheduleService"),
		clusterv1.File_pivirt_cluster_v1_agent_proto.Services().ByName("AgentService"),
	}, apiServices...)
}

// RBACResource is the resource of the cluster-wide RBAC policy (the config
// key auth.rbac_policy): changing who may do what is not an ordinary
// config update.
const RBACResource = gateway.RBACResource

// policyResources are the resources a policy may name.
func policyResources(schemas []*mesh.Schema) []string {
	sds := apiDescriptors()
	for _, s := range schemas {
		sds = append(sds, s.ServiceDescriptors()...)
	}
	return slices.Compact(slices.Sorted(slices.Values(append(authz.Resources(sds...), RBACResource))))
}

// policyResources are the resources a policy may name with the routes in
// use: those of the APIs linked in, RBACResource, and those the
// annotations of the routes' descriptor sets name.
func (a *Agent) policyResources() []string {
	var schemas []*mesh.Schema
	if a.proxy != nil {
		schemas = a.proxy.Schemas()
	}
	return policyResources(schemas)
}

// configResource guards the keys that decide who may do what
// (gateway.SecurityKeys: auth.rbac_policy, auth.certificate_roles,
// auth.network_policy) as the resource rbac: SetConfig and DeleteConfig of
// them need update and delete on rbac, not on config.
func configResource(procedure string, req protoreflect.Message) (string, bool) {
	switch procedure {
	case clusterv1connect.ClusterServiceSetConfigProcedure, clusterv1connect.ClusterServiceDeleteConfigProcedure:
		if key, ok := authz.FieldString(req, "key"); ok && gateway.IsSecurityKey(key) {
			return RBACResource, true
		}
	}
	return "", false
}

// breakGlass lets a node's own agent certificate (CN
// pivirt-agent-<node_name>) delete the cluster-wide RBAC policy whatever
// the policy says: the way out of a policy that locks every operator out,
// for someone on the node (the key file is readable only there). It holds
// for this node's certificate on this node's API port, and for a node's
// certificate that its own agent relayed (via): never for another node's.
func (a *Agent) breakGlass(procedure string, req protoreflect.Message, who authz.Principal, via string) bool {
	if procedure != clusterv1connect.ClusterServiceDeleteConfigProcedure || !who.Certificate {
		return false
	}
	if own := identity.AgentPrefix + a.cfg.NodeName; via == "" && who.Identity != own || via != "" && who.Identity != via {
		return false
	}
	key, ok := authz.FieldString(req, "key")
	return ok && key == RBACPolicyKey
}

// ConfigWarnings are what a configuration leaves out without an error
// (access control, backends' TLS): said at start and by pivirt-agent
// validate.
func ConfigWarnings(cfg *config.Config) []string {
	var out []string
	for _, name := range slices.Sorted(maps.Keys(cfg.Backends)) {
		bt := cfg.Backends[name].TLS
		if !bt.Enabled && (bt.CertFile != "" || bt.KeyFile != "" || bt.CAFile != "" || bt.ServerName != "") {
			out = append(out, fmt.Sprintf("backends.%s.tls names files or a server name but its enabled is false: they are not used "+
				"(an https:// endpoint is verified by the system's trust store, without a client certificate; any other is plaintext); set enabled: true to use them", name))
		}
	}
	ac := cfg.Auth
	if ac.OIDC.IssuerURL != "" && cfg.TLS.Enabled && cfg.TLS.RequireClientCert {
		out = append(out, "auth.oidc is set, but tls.require_client_cert is true: the API port's TLS handshake refuses a caller without a client certificate "+
			"of the PiTrust chain before any token is read, so a bearer token alone (the web console in a browser, grpcurl -H \"authorization: Bearer …\" without -cert) cannot call; "+
			"set tls.require_client_cert: false to take tokens without a certificate (every call still needs a token or a certificate)")
	}
	if ac.RBACPolicy != "" && cfg.TLS.Enabled && len(ac.CertificateRoles) == 0 {
		out = append(out, "auth.certificate_roles is empty: a caller with a client certificate (pvcli with its certificate) has no role, "+
			"so auth.rbac_policy's rules allow it nothing, unless the cluster setting auth.certificate_roles gives it roles; "+
			"map certificate names to roles, e.g. certificate_roles: {operator: [admin]}")
	}
	return out
}

// startAccess builds the API port's access control. It is off (every call
// allowed, with a warning) only when nothing could authenticate a caller:
// tls.enabled false and neither auth.oidc nor auth.rbac_policy set.
func (a *Agent) startAccess() error {
	for _, w := range ConfigWarnings(a.cfg) {
		a.logger.Warn(w)
	}
	ac := a.cfg.Auth
	if !a.cfg.TLS.Enabled && ac.OIDC.IssuerURL == "" && ac.RBACPolicy == "" {
		a.logger.Warn("ACCESS CONTROL IS OFF: the API port accepts every call without credentials (tls.enabled is false and neither auth.oidc nor auth.rbac_policy is set)")
		return nil
	}
	auth := &authn.Authenticator{CertRoles: ac.CertificateRoles}
	a.authn = auth
	if ac.OIDC.IssuerURL != "" {
		a.wg.Add(1)
		auth.OIDC = authn.Discover(a.ctx, authn.OIDCConfig{
			IssuerURL:     ac.OIDC.IssuerURL,
			ClientID:      ac.OIDC.ClientID,
			IdentityClaim: ac.OIDC.IdentityClaim,
			RolesClaim:    ac.OIDC.RolesClaim,
			Logger:        a.logger,
		}, a.wg.Done)
	}
	if ac.RBACPolicy != "" {
		f, err := authz.LoadFileFunc(ac.RBACPolicy, a.policyResources, a.logger)
		if err != nil {
			return err
		}
		a.policyFile = f
		a.wg.Go(func() { f.Watch(a.ctx, policyWatchInterval) })
	} else {
		a.logger.Warn("no auth.rbac_policy: every authenticated caller may call every method; set a policy to restrict them")
	}
	a.clusterPolicy = leader.NewClusterPolicy(leader.PolicyConfig{
		Key:       RBACPolicyKey,
		Resources: a.policyResources,
		DataDir:   a.dataDir,
		FSM:       a.fsm,
		ReadConsistent: func(ctx context.Context) error {
			_, err := a.api.GetConfig(ctx, connect.NewRequest(&clusterv1.GetConfigRequest{
				Key: RBACPolicyKey, Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
			}))
			return err
		},
		HoldTimeout:  a.cfg.Cluster.ForwardHoldTimeout.Std(),
		FallbackFile: a.cfg.Auth.RBACPolicy,
		Logger:       a.logger,
	})
	if a.clusterPolicy.LoadPersisted() || a.policyFile != nil {
		a.clusterPolicy.SetUsable()
	}
	a.wg.Go(func() { a.clusterPolicy.Run(a.ctx) })
	g, err := access.New(access.Config{
		Authenticator: auth,
		Policy:        a.policy,
		Routed:        func(m string) bool { return a.proxy != nil && a.proxy.Route(m) != nil },
		// The descriptor sets of the routing rules, never a schema
		// learned from a backend's reflection: the authorization of a
		// backend does not come from the backend it protects.
		Schema: func(m string) protoreflect.MethodDescriptor {
			if a.proxy == nil {
				return nil
			}
			return a.proxy.DescriptorSetMethod(m)
		},
		Limits:     rateLimits(a.cfg.RateLimiting),
		Fetch:      a.fetchObject,
		Ready:      a.clusterPolicy.Ready,
		Resource:   configResource,
		BreakGlass: a.breakGlass,
		VerifyClientChain: func(chain []*x509.Certificate) error {
			if a.tls == nil {
				return errors.New("TLS is off on this agent")
			}
			return a.tls.api.VerifyChain(chain, x509.ExtKeyUsageClientAuth)
		},
		ConnState:   gateway.ConnTLSFromContext,
		Logger:      a.logger.With("component", "access"),
		Registerer:  a.metrics,
		MaxStreams:  orNoBound(a.cfg.Server.ConnectRPC.MaxStreamsPerCaller),
		BodyTimeout: time.Duration(orNoBound(int64(a.cfg.Server.ConnectRPC.BodyTimeout))),
	})
	if err != nil {
		return err
	}
	a.guard = g
	// A restore needs the rights of every resource it changes, checked by
	// the leader against its plan: for the caller of this port, or the
	// caller an agent relayed to the internal port.
	a.snapshots.SetAuthorize(g.AuthorizeResource)
	a.internalSnapshots.SetAuthorize(g.AuthorizeResource)
	return nil
}

// orNoBound maps a configuration's 0 ("no bound") to the guard's negative.
func orNoBound[T int | int64](v T) T {
	if v == 0 {
		return -1
	}
	return v
}

// policy is the RBAC policy in force: the cluster-wide one when set, else
// the auth.rbac_policy file's, else none.
func (a *Agent) policy() *authz.Policy {
	if p := a.clusterPolicy.Policy(); p != nil {
		return p
	}
	if a.policyFile != nil {
		return a.policyFile.Policy()
	}
	return nil
}

// accessServerOptions are the API port's gRPC interceptors: request
// metrics, then access control.
func (a *Agent) accessServerOptions() []grpc.ServerOption {
	unary := []grpc.UnaryServerInterceptor{a.apiMetrics.UnaryServerInterceptor()}
	// A JSON caller of a schema the agent has is seen in proto from here.
	stream := []grpc.StreamServerInterceptor{mesh.ReleaseStreamBody, a.proxy.TranscodeJSON, a.apiMetrics.StreamServerInterceptor()}
	if a.guard != nil {
		unary = append(unary, a.guard.UnaryServerInterceptor())
		stream = append(stream, a.guard.StreamServerInterceptor())
	}
	tapHandle := a.codecTap
	if a.guard != nil {
		// Authenticated first: the codec's refusal tells nothing of the
		// routes to a caller without credentials.
		tapHandle = func(ctx context.Context, info *tap.Info) (context.Context, error) {
			ctx, err := a.guard.TapHandle(ctx, info)
			if err != nil {
				return nil, err
			}
			if _, err := a.codecTap(ctx, info); err != nil {
				access.StopBodyTimer(ctx)
				return nil, err
			}
			return ctx, nil
		}
	}
	return []grpc.ServerOption{grpc.ChainUnaryInterceptor(unary...), grpc.ChainStreamInterceptor(stream...), grpc.InTapHandle(tapHandle)}
}

// codecTap refuses, before anything of it is read, a gRPC call in a codec
// the API port cannot serve it in: a routed service the agent has no
// schema of takes any codec (its bytes pass untouched); the VM, storage
// and network APIs take proto and JSON (transcoded, mesh.TranscodeJSON);
// the agent's own APIs take proto (JSON over Connect).
func (a *Agent) codecTap(ctx context.Context, info *tap.Info) (context.Context, error) {
	var ct string
	if v := info.Header["content-type"]; len(v) > 0 {
		ct = v[0]
	}
	if ct == "application/grpc" || ct == "application/grpc+proto" {
		return ctx, nil
	}
	_, sub, _ := strings.Cut(strings.SplitN(ct, ";", 2)[0], "+")
	sub = strings.ToLower(strings.TrimSpace(sub))
	if sub == "" || sub == "proto" {
		return ctx, nil
	}
	routed := a.proxy != nil && a.proxy.Route(info.FullMethodName) != nil
	switch {
	case routed && !a.proxy.HasFixedSchema(info.FullMethodName):
		// No schema known before the call (a schema learned from the
		// backend's reflection is not waited for here, on the
		// connection's reader): any codec goes to the backend as it is.
		return ctx, nil
	case routed && sub == "json":
		return ctx, nil
	case routed:
		return nil, status.Errorf(codes.Unimplemented, "%s in codec %q: this API takes gRPC with the proto and json codecs (application/grpc, application/grpc+json)", info.FullMethodName, sub)
	}
	return nil, status.Errorf(codes.Unimplemented, "%s in codec %q: the agent's own APIs take gRPC with the proto codec (application/grpc); for JSON call them with Connect (content type application/json)", info.FullMethodName, sub)
}

// fetchObject reads the object a conditional RBAC rule is checked against,
// with the service's get method, from the backend that serves it.
func (a *Agent) fetchObject(ctx context.Context, get protoreflect.MethodDescriptor, req protoreflect.ProtoMessage) (protoreflect.ProtoMessage, error) {
	method := "/" + string(get.Parent().FullName()) + "/" + string(get.Name())
	if method == schedulev1connect.ScheduleServiceGetScheduleProcedure {
		// Served here.
		r, ok := req.(*schedulev1.GetScheduleRequest)
		if !ok {
			return nil, status.Errorf(codes.Internal, "%s: request of type %T", method, req)
		}
		resp, err := a.schedules.GetSchedule(ctx, connect.NewRequest(r))
		if err != nil {
			return nil, status.Error(codes.Code(connect.CodeOf(err)), err.Error())
		}
		return resp.Msg, nil
	}
	var resp protoreflect.ProtoMessage
	if mt, err := protoregistry.GlobalTypes.FindMessageByName(get.Output().FullName()); err == nil {
		resp = mt.New().Interface()
	} else {
		resp = dynamicpb.NewMessage(get.Output())
	}
	if access.ViaFrom(ctx) != "" {
		// Another agent routed the call here, where its object lives:
		// the conditions read it here.
		if err := a.proxy.InvokeHere(ctx, method, req, resp); err != nil {
			return nil, err
		}
		return resp, nil
	}
	// Where the object lives: the conditions read it on its node.
	if _, err := a.proxy.Invoke(ctx, method, req, resp); err != nil {
		return nil, err
	}
	return resp, nil
}

// validateClusterConfig checks a change of the cluster config before it
// is stored: a cluster setting must decode and validate
// (config.ParseSetting, the code that applies it); other keys must be
// free-form (config.FreeFormPrefix). A change of a key that decides who may
// do what (gateway.SecurityKeys) must not, unless forced, leave the caller
// unable to change the RBAC policy again (checkLockOut), nor a network
// policy cut the agents off from each other (checkAgentsReach); a
// cluster-wide RBAC policy must also leave some role able to change it.
func (a *Agent) validateClusterConfig(ctx context.Context, c gateway.ConfigChange) error {
	switch c.Key {
	case RBACPolicyKey:
		var next *authz.Policy // after the change; nil: none, every call allowed
		if !c.Delete {
			p, err := authz.Parse(strings.NewReader(c.Value), a.policyResources())
			if err != nil {
				return err
			}
			if !p.Grants(RBACResource, "update") {
				return fmt.Errorf("%w: no rule lets any role update %s without conditions: the policy could never be changed or removed again", authz.ErrInvalidPolicy, RBACResource)
			}
			next = p
		} else if a.policyFile != nil {
			next = a.policyFile.Policy() // the file's applies again
		}
		if c.Restore || c.Force {
			return nil
		}
		what := "this policy"
		if c.Delete {
			what = "deleting the cluster policy (the auth.rbac_policy file then applies)"
		}
		return a.checkLockOut(ctx, what, next, nil)
	case NetworkPolicyKey:
		if c.Delete {
			return nil
		}
		p, err := netpolicy.Parse(strings.NewReader(c.Value))
		if err != nil {
			return fmt.Errorf("%s: %w", NetworkPolicyKey, err)
		}
		if c.Restore || c.Force {
			return nil
		}
		return a.checkAgentsReach(p)
	case CertificateRolesKey:
		// The table in force on this node after the change: the value, or
		// the file's once the key is deleted, or the file's if it pins it.
		table := a.fileCfg.Load().Auth.CertificateRoles
		if !c.Delete {
			cfg, err := config.ParseSetting(c.Key, c.Value)
			if err != nil {
				return err
			}
			if !a.fileCfg.Load().Pinned(c.Key) {
				table = cfg.Auth.CertificateRoles
			}
		}
		if c.Restore || c.Force {
			return nil
		}
		what := "these certificate roles"
		if c.Delete {
			what = "deleting the cluster's certificate roles (each node's auth.certificate_roles then applies)"
		}
		return a.checkLockOut(ctx, what, a.policy(), func(who authz.Principal) []string {
			if !who.Certificate {
				return who.Roles // a token's roles are the token's
			}
			return authn.RolesFor(table, who.Identity)
		})
	}
	if c.Delete {
		return nil
	}
	_, _, ok, err := config.LookupSetting(c.Key)
	switch {
	case c.Restore && (err != nil || !ok):
		// An archive may hold keys of any version: only the settings this
		// version knows are checked.
		return nil
	case err != nil:
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("key: %w", err))
	}
	_, err = config.ParseSetting(c.Key, c.Value)
	return err
}

// CertificateRolesKey is the cluster setting auth.certificate_roles.
const CertificateRolesKey = "auth.certificate_roles"

// checkLockOut refuses a change after which the caller of this request
// could no longer update the RBAC policy although it can now: next is the
// policy in force after it, roles (nil: unchanged) the caller's roles
// after it. The refusal names every right the caller would lose. Without a
// caller in ctx (a call relayed by another agent, checked there; access
// control off) there is nothing to check.
func (a *Agent) checkLockOut(ctx context.Context, what string, next *authz.Policy, roles func(authz.Principal) []string) error {
	who, ok := authz.PrincipalFrom(ctx)
	if !ok {
		return nil
	}
	after := who
	if roles != nil {
		after.Roles = roles(who)
	}
	allowed := func(p *authz.Policy, w authz.Principal, resource, verb string) bool {
		if p == nil {
			return true
		}
		d, err := p.Decide(w, resource, verb)
		return err == nil && d.Allowed
	}
	cur := a.policy()
	if !allowed(cur, who, RBACResource, "update") || allowed(next, after, RBACResource, "update") {
		return nil
	}
	var lost []string
	everything := true
	for _, r := range a.policyResources() {
		var verbs []string
		for _, v := range authz.Verbs {
			if allowed(cur, who, r, v) && !allowed(next, after, r, v) {
				verbs = append(verbs, v)
			}
		}
		switch {
		case len(verbs) == len(authz.Verbs):
			lost = append(lost, r+" (every verb)")
		case len(verbs) > 0:
			lost = append(lost, r+" ("+strings.Join(verbs, ", ")+")")
			everything = false
		default:
			everything = false
		}
	}
	if everything {
		lost = []string{"every verb on every resource"}
	}
	roleDesc := "roles " + rolesList(who.Roles)
	if roles != nil {
		roleDesc += ", then " + rolesList(after.Roles)
	}
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf(
		"%s would lock you out: %s (%s) could no longer update %s, so could not change or remove it again; you would lose: %s. Keep update on %s for one of your roles, or pass --force (force: true) to store it anyway",
		what, who.Identity, roleDesc, RBACResource, strings.Join(lost, "; "), RBACResource))
}

func rolesList(roles []string) string {
	if len(roles) == 0 {
		return "none"
	}
	return strings.Join(roles, ", ")
}

// checkAgentsReach refuses a network policy that would not let this
// node's agent identity reach the agents' internal and Raft ports (of
// every member, as gossip advertises them): every node enforces the
// cluster's policy on the connections already open, so it would cut the
// cluster apart and no write could undo it. Other agents are taken to
// hold certificates of the same service names as this one.
func (a *Agent) checkAgentsReach(p *netpolicy.Set) error {
	if a.tls == nil {
		return nil
	}
	from, to := netpolicy.Identities(a.tls.client.Leaf()), netpolicy.Identities(a.tls.internal.Leaf())
	ports := map[int]string{}
	addPort := func(addr, what string) {
		if _, port, err := net.SplitHostPort(addr); err == nil {
			if n, err := strconv.Atoi(port); err == nil {
				ports[n] = what
			}
		}
	}
	addPort(a.InternalAddr(), "internal")
	addPort(a.RaftAddr(), "raft")
	if a.gossip != nil {
		for _, m := range a.gossip.Members() {
			addPort(m.Meta.InternalAddr, "internal")
			addPort(m.Meta.RaftAddr, "raft")
		}
	}
	var cut []string
	var cutPorts []string
	for _, port := range slices.Sorted(maps.Keys(ports)) {
		if ok, _ := p.Allows(from, to, port); !ok {
			cut = append(cut, fmt.Sprintf("%s port %d", ports[port], port))
			cutPorts = append(cutPorts, fmt.Sprintf("{port: %d}", port))
		}
	}
	if len(cut) == 0 {
		return nil
	}
	allow := "allow them"
	if f := serviceName(from); f != "" {
		// No "to": every agent's ports, whatever names their server
		// certificates carry (this node's may be its own).
		allow = fmt.Sprintf("allow them (e.g. add to spec.ingress: {from: [{service: %q}], ports: [%s]})", f, strings.Join(cutPorts, ", "))
	}
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf(
		"this network policy would cut the agents off from each other: no NetworkPolicy allows %s to connect to %s on the %s, and every node closes the connections it no longer allows; %s, or pass --force (force: true) to store it anyway",
		names(from, a.tls.client.Leaf()), names(to, a.tls.internal.Leaf()), strings.Join(cut, ", "), allow))
}

// serviceName is the first of a certificate's identities that is a DNS
// name (what a NetworkPolicy's service usually names), else the first.
func serviceName(ids []string) string {
	for _, id := range ids {
		if !strings.Contains(id, ":") && id != "localhost" {
			return id
		}
	}
	if len(ids) > 0 {
		return ids[0]
	}
	return ""
}

// checkAccess answers ClusterService.CheckAccess with the guard and the
// policy in force here.
func (a *Agent) checkAccess(_ context.Context, req *clusterv1.CheckAccessRequest) (*clusterv1.CheckAccessResponse, error) {
	if a.guard == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("access control is off on this agent: every call is allowed"))
	}
	method, err := fullMethod(req.GetMethod())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("method: %w", err))
	}
	who := authz.Principal{Identity: req.GetIdentity(), Roles: req.GetRoles()}
	e, err := a.guard.Explain(who, method, req.GetObjectJson())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	source := a.policySource()
	if method == clusterv1connect.ClusterServiceSetConfigProcedure || method == clusterv1connect.ClusterServiceDeleteConfigProcedure {
		e.Detail = strings.TrimSpace(e.Detail + " (for the keys " + strings.Join(gateway.SecurityKeys, ", ") + " the resource is " + RBACResource + ", not config)")
	}
	return &clusterv1.CheckAccessResponse{
		Allowed: e.Allowed, Method: method, Resource: e.Resource, Verb: e.Verb, Decision: e.Decision,
		Rules: e.Rules, Source: source, Detail: e.Detail,
	}, nil
}

// policySource is where the RBAC policy in force here comes from:
// "cluster", "file" or "none".
func (a *Agent) policySource() string {
	switch {
	case a.clusterPolicy.Policy() != nil:
		return "cluster"
	case a.policyFile != nil:
		return "file"
	}
	return "none"
}

// explain is the guard's answer for who calling procedure (WhoAmI asks
// it for each method); FailedPrecondition when access control is off.
func (a *Agent) explain(who authz.Principal, procedure, objectJSON string) (access.Explanation, error) {
	if a.guard == nil {
		return access.Explanation{}, connect.NewError(connect.CodeFailedPrecondition, errors.New("access control is off on this agent: every call is allowed"))
	}
	return a.guard.Explain(who, procedure, objectJSON)
}

// fullMethod resolves "VMService/DeleteVM" (a service of the API by its
// short name) or "pivirt.vm.v1.VMService/DeleteVM" to
// "/pivirt.vm.v1.VMService/DeleteVM".
func fullMethod(m string) (string, error) {
	return gateway.ResolveMethod(apiDescriptors(), m)
}

// checkNetworkPolicyRPC answers ClusterService.CheckNetworkPolicy with the
// network policy in force here.
func (a *Agent) checkNetworkPolicyRPC(_ context.Context, req *clusterv1.CheckNetworkPolicyRequest) (*clusterv1.CheckNetworkPolicyResponse, error) {
	pol, source := a.networkPolicy()
	if pol == nil {
		return &clusterv1.CheckNetworkPolicyResponse{Allowed: true, Source: "none"}, nil
	}
	ok, name := pol.Allows([]string{req.GetFrom()}, []string{req.GetTo()}, int(req.GetPort()))
	return &clusterv1.CheckNetworkPolicyResponse{Allowed: ok, Policy: name, Source: source}, nil
}

// Reload reads the files the agent can take up without a restart again
// (SIGHUP, POST /reload): certificates and the RBAC policy file. What
// fails to load stays as it was; the error names it.
func (a *Agent) Reload() (reloaded []string, err error) {
	reloaded = []string{}
	var errs []error
	if a.tls != nil {
		if err := a.ReloadTLS(); err != nil {
			errs = append(errs, err)
		} else {
			reloaded = append(reloaded, "tls")
		}
	}
	if a.policyFile != nil {
		if err := a.policyFile.Reload(); err != nil {
			errs = append(errs, err)
		} else {
			reloaded = append(reloaded, "auth.rbac_policy")
		}
	}
	if a.netPolicy != nil {
		if err := a.netPolicy.Reload(); err != nil {
			errs = append(errs, err)
		} else {
			reloaded = append(reloaded, "auth.network_policy")
		}
	}
	return reloaded, errors.Join(errs...)
}

// reloadHandler is POST /reload, as SIGHUP: the configuration read again
// (when the agent knows how: Options.LoadConfig) and applied where it can
// change live — refused whole when it does not load, validate or apply,
// the running one staying — then the files it names (certificates,
// policies), reloaded either way. 200 when everything worked, else 422
// naming what did not.
func (a *Agent) reloadHandler(w http.ResponseWriter, r *http.Request) {
	body := map[string]any{"status": "ok"}
	var errs []error
	if a.opts.LoadConfig != nil {
		next, err := a.opts.LoadConfig()
		if err == nil {
			var applied, restart []string
			if applied, restart, err = a.ReloadConfig(next); err == nil {
				body["applied"], body["restart_required"] = nonNil(applied), nonNil(restart)
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("configuration not reloaded, the running one stays: %w", err))
		}
	}
	reloaded, err := a.Reload()
	body["reloaded"] = reloaded
	if err != nil {
		errs = append(errs, fmt.Errorf("%w (what failed to load stays in use)", err))
	}
	if len(errs) > 0 {
		body["status"], body["error"] = "error", errors.Join(errs...).Error()
		writeJSON(w, http.StatusUnprocessableEntity, body)
		return
	}
	writeJSON(w, http.StatusOK, body)
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// invokeBackend calls a backend method through the gateway's backend
// clusters (the power schedules' actions), on the node that holds the
// call's object; it returns that node's name.
func (a *Agent) invokeBackend(ctx context.Context, method string, req, resp proto.Message) (string, error) {
	b := a.proxy.Route(method)
	if b == nil {
		return "", status.Errorf(codes.FailedPrecondition, "no routing rule sends %s to a backend", method)
	}
	ctx = authz.WithPrincipal(ctx, authz.Principal{Identity: SchedulerIdentity})
	node, err := a.proxy.Invoke(ctx, method, req, resp)
	if err != nil && status.Code(err) == codes.Unavailable && !b.Healthy() && (node == "" || node == a.cfg.NodeName) {
		return node, fmt.Errorf("backend %s: %w", b.Name(), scheduler.ErrNoBackend)
	}
	return node, err
}

// SchedulerIdentity is who the power schedules' actions are made by, as
// backends see it (x-pivirt-identity).
const SchedulerIdentity = "pivirt-scheduler"

// unprefixed is err without the prefix its message starts with: the
// configuration key already says it ("tls: tls: stat …" otherwise).
type unprefixed struct {
	err    error
	prefix string
}

func (u unprefixed) Error() string { return strings.TrimPrefix(u.err.Error(), u.prefix) }
func (u unprefixed) Unwrap() error { return u.err }

// checkClusterCAFiles checks tls.cluster_ca's intermediate as a leader
// installing it would: it parses with its key and chains to tls.ca_file
// (trust: the tls block's source).
func checkClusterCAFiles(cfg *config.Config, trust *identity.Source) error {
	cc := cfg.TLS.ClusterCA
	if !cc.Enabled || cc.CertFile == "" {
		return nil
	}
	certPEM, err := os.ReadFile(cc.CertFile)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca.cert_file: %w", err)
	}
	keyPEM, err := os.ReadFile(cc.KeyFile)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca.key_file: %w", err)
	}
	ca, err := identity.ParseCertAuthority(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca: %w", err)
	}
	if err := trust.VerifyChain(ca.Chain, x509.ExtKeyUsageAny); err != nil {
		return fmt.Errorf("tls.cluster_ca.cert_file %s does not chain to tls.ca_file, so certificates it signs would not be trusted: %w", cc.CertFile, err)
	}
	return nil
}
