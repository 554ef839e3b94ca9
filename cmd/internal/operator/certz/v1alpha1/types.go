package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The certificate types: the kinds of PiTrust leaves.
const (
	TypeMTLSServer = "mtls-server"
	TypeMTLSClient = "mtls-client"
)

// Key algorithms and rotation policies.
const (
	AlgorithmECDSA   = "ECDSA"
	AlgorithmRSA     = "RSA"
	AlgorithmEd25519 = "Ed25519"

	RotationAlways = "Always"
	RotationNever  = "Never"
)

// Revocation policies.
const (
	// RevokeOnDelete revokes the certificate when the resource is deleted,
	// and a certificate replaced before its renewal time (the spec changed,
	// the Secret was deleted or tampered with, a renewal was requested).
	RevokeOnDelete = "OnDelete"
	// RevokeOnRenewal also revokes each scheduled renewal's predecessor.
	RevokeOnRenewal = "OnRenewal"
	// RevokeNever revokes nothing.
	RevokeNever = "Never"
)

// Condition types and the Secret's annotations.
const (
	ConditionReady   = "Ready"
	ConditionIssuing = "Issuing"
)

// ManagedCertificateSpec is the certificate wanted: its names, lifetime,
// issuer, key and the Secret it is written to.
//
// +kubebuilder:validation:XValidation:rule="!has(self.renewBefore) || duration(self.renewBefore) >= duration('1m')",message="renewBefore must be at least 1m"
// +kubebuilder:validation:XValidation:rule="!(has(self.usages) ? 'server' in self.usages : self.type == 'mtls-server') || (has(self.dnsNames) && size(self.dnsNames) > 0) || (has(self.ipAddresses) && size(self.ipAddresses) > 0) || self.commonName.matches('^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?([.][A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$')",message="a certificate with the server usage needs dnsNames or ipAddresses (or a commonName that is a host name)"
// +kubebuilder:validation:XValidation:rule="!has(self.usages) || (self.type == 'mtls-client' ? 'client' : 'server') in self.usages",message="usages must hold the type's own usage (server for mtls-server, client for mtls-client)"
// +kubebuilder:validation:XValidation:rule="!has(self.issuerRef) || !has(self.issuerRef.secretName) || self.issuerRef.secretName != self.secretName",message="secretName must not be the issuer's Secret (issuerRef.secretName)"
type ManagedCertificateSpec struct {
	// CommonName is the certificate's subject CN; for an mtls-server
	// certificate without dnsNames it is also its DNS name.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=128
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9][A-Za-z0-9._-]*$`
	CommonName string `json:"commonName"`

	// Type is the kind of PiTrust certificate: mtls-server (server
	// authentication) or mtls-client (client authentication); usages adds
	// the other.
	// +kubebuilder:validation:Enum=mtls-server;mtls-client
	// +kubebuilder:default=mtls-server
	// +optional
	Type string `json:"type,omitempty"`

	// Usages narrows or widens the extended key usages: server, client
	// (default: the type's own).
	// +listType=set
	// +kubebuilder:validation:MaxItems=2
	// +optional
	Usages []Usage `json:"usages,omitempty"`

	// DNSNames and IPAddresses are the subject alternative names.
	// +listType=set
	// +kubebuilder:validation:MaxItems=100
	// +kubebuilder:validation:items:MaxLength=253
	// +kubebuilder:validation:items:Pattern=`^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$`
	// +optional
	DNSNames []string `json:"dnsNames,omitempty"`
	// +listType=set
	// +kubebuilder:validation:MaxItems=100
	// +kubebuilder:validation:items:XValidation:rule="isIP(self)",message="must be an IPv4 or IPv6 address"
	// +kubebuilder:validation:items:MaxLength=45
	// +optional
	IPAddresses []string `json:"ipAddresses,omitempty"`

	// Cluster binds an agent's client certificate (pivirt-agent-<node>) to
	// the agents' cluster.name: the URI name urn:pivirt:cluster:<cluster>.
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$`
	// +optional
	Cluster string `json:"cluster,omitempty"`

	// SecretName is the kubernetes.io/tls Secret, in the resource's
	// namespace, that holds tls.crt (the certificate and the X1
	// intermediate), tls.key and ca.crt (the intermediate and the root).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	SecretName string `json:"secretName"`

	// Duration is the certificate's lifetime (a Go duration, default
	// 8760h; at least 1m).
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1m')",message="duration must be at least 1m"
	// +kubebuilder:default="8760h"
	// +optional
	Duration *metav1.Duration `json:"duration,omitempty"`

	// RenewBefore is how long before expiry the certificate is renewed
	// (default 720h). When it is not shorter than the duration, the
	// certificate is renewed two thirds into its life.
	// +kubebuilder:default="720h"
	// +optional
	RenewBefore *metav1.Duration `json:"renewBefore,omitempty"`

	// IssuerRef says where the certificate comes from: a PiTrust CA server
	// (url, caBundle) or a Secret holding the X1 intermediate (secretName).
	// Empty: the operator's default CA server (pitrust operator --ca-server).
	// +optional
	IssuerRef *IssuerRef `json:"issuerRef,omitempty"`

	// PrivateKey is the key's algorithm and rotation policy.
	// +optional
	PrivateKey *PrivateKey `json:"privateKey,omitempty"`

	// RevocationPolicy: OnDelete (default) revokes the certificate when the
	// resource is deleted and when a certificate is replaced before its
	// renewal time; OnRenewal also revokes each renewal's predecessor;
	// Never revokes nothing. A CA server issuer only.
	// +kubebuilder:validation:Enum=OnDelete;OnRenewal;Never
	// +kubebuilder:default=OnDelete
	// +optional
	RevocationPolicy string `json:"revocationPolicy,omitempty"`

	// SecretTemplate holds labels and annotations copied to the Secret.
	// +optional
	SecretTemplate *SecretTemplate `json:"secretTemplate,omitempty"`
}

// Usage is an extended key usage: server or client.
// +kubebuilder:validation:Enum=server;client
type Usage string

// IssuerRef names the issuer: a CA server or a Secret, not both.
//
// +kubebuilder:validation:XValidation:rule="!(has(self.url) && has(self.secretName))",message="issuerRef: name either url (a CA server) or secretName (the X1 intermediate), not both"
// +kubebuilder:validation:XValidation:rule="!has(self.caBundle) || has(self.url)",message="issuerRef.caBundle belongs to a CA server url"
type IssuerRef struct {
	// URL is the PiTrust CA server's API (https://host:port).
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="isURL(self) && url(self).getScheme() == 'https' && url(self).getHostname() != ''",message="issuerRef.url must be an https://host:port URL"
	// +optional
	URL string `json:"url,omitempty"`
	// CABundle is the PEM CA chain the CA server's certificate is checked
	// against (default: the operator's --ca-bundle).
	// +optional
	CABundle []byte `json:"caBundle,omitempty"`
	// SecretName names a Secret in the resource's namespace holding the
	// X1 intermediate (PiCA.pem, PiCA.key) and ca-chain.pem, for offline
	// issuance without a CA server (no revocation then).
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +optional
	SecretName string `json:"secretName,omitempty"`
}

// PrivateKey is the key wanted.
//
// +kubebuilder:validation:XValidation:rule="!has(self.size) || (has(self.algorithm) && self.algorithm != 'Ed25519')",message="privateKey.size applies to RSA (2048, 3072, 4096) and ECDSA (256, 384, 521)"
// +kubebuilder:validation:XValidation:rule="!has(self.size) || self.algorithm != 'RSA' || self.size in [2048, 3072, 4096]",message="privateKey.size of an RSA key: 2048, 3072 or 4096"
// +kubebuilder:validation:XValidation:rule="!has(self.size) || self.algorithm != 'ECDSA' || self.size in [256, 384, 521]",message="privateKey.size of an ECDSA key: 256, 384 or 521"
type PrivateKey struct {
	// Algorithm: ECDSA (default, P-256), RSA or Ed25519.
	// +kubebuilder:validation:Enum=ECDSA;RSA;Ed25519
	// +kubebuilder:default=ECDSA
	// +optional
	Algorithm string `json:"algorithm,omitempty"`
	// Size is the RSA key's bits or the ECDSA curve's (256, 384, 521).
	// +optional
	Size int `json:"size,omitempty"`
	// RotationPolicy: Always (default) makes a new key at every issuance;
	// Never keeps the Secret's key while it fits the spec.
	// +kubebuilder:validation:Enum=Always;Never
	// +kubebuilder:default=Always
	// +optional
	RotationPolicy string `json:"rotationPolicy,omitempty"`
}

// SecretTemplate is metadata for the Secret. The operator's own keys
// (certz.pilab.hu/…) are not a template's to set.
//
// +kubebuilder:validation:XValidation:rule="!has(self.labels) || self.labels.all(k, !k.startsWith('certz.pilab.hu/'))",message="secretTemplate.labels: keys under certz.pilab.hu/ are the operator's"
// +kubebuilder:validation:XValidation:rule="!has(self.annotations) || self.annotations.all(k, !k.startsWith('certz.pilab.hu/'))",message="secretTemplate.annotations: keys under certz.pilab.hu/ are the operator's"
type SecretTemplate struct {
	// +optional
	Labels map[string]string `json:"labels,omitempty"`
	// +optional
	Annotations map[string]string `json:"annotations,omitempty"`
}

// ManagedCertificateStatus is what the operator last did.
type ManagedCertificateStatus struct {
	// Conditions: Ready (the Secret holds a valid certificate of the
	// spec) and Issuing (an issuance is due or under way).
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// NotBefore and NotAfter are the current certificate's validity.
	// +optional
	NotBefore *metav1.Time `json:"notBefore,omitempty"`
	// +optional
	NotAfter *metav1.Time `json:"notAfter,omitempty"`
	// RenewalTime is when the operator renews it.
	// +optional
	RenewalTime *metav1.Time `json:"renewalTime,omitempty"`
	// Revision counts the certificates issued for this resource.
	// +optional
	Revision int64 `json:"revision,omitempty"`
	// SerialNumber is the current certificate's serial (hexadecimal).
	// +optional
	SerialNumber string `json:"serialNumber,omitempty"`
	// LastFailureTime is when the last issuance failed; cleared by a
	// success. FailedIssuanceAttempts counts the failures since.
	// +optional
	LastFailureTime *metav1.Time `json:"lastFailureTime,omitempty"`
	// +optional
	FailedIssuanceAttempts int `json:"failedIssuanceAttempts,omitempty"`
	// PendingRevocations are certificates this resource replaced that are
	// to be revoked: after revokeAfter (the operator's --revocation-delay,
	// time for pods to take up the new Secret), or again after a failure.
	// +listType=map
	// +listMapKey=serialNumber
	// +optional
	PendingRevocations []PendingRevocation `json:"pendingRevocations,omitempty"`
	// ObservedGeneration is the generation of the spec the status is of.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
}

// PendingRevocation is a certificate to revoke.
type PendingRevocation struct {
	// SerialNumber is the certificate's serial (hexadecimal).
	SerialNumber string `json:"serialNumber"`
	// Reason is an RFC 5280 reason name (superseded).
	Reason string `json:"reason"`
	// RevokeAfter is when it is revoked.
	RevokeAfter metav1.Time `json:"revokeAfter"`
}

// ManagedCertificate is a certificate the PiTrust operator keeps in a
// kubernetes.io/tls Secret, issued by PiTrust and renewed before expiry.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=mcert;mcerts,categories=pitrust
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Secret",type=string,JSONPath=`.spec.secretName`
// +kubebuilder:printcolumn:name="Expires",type=string,JSONPath=`.status.notAfter`
// +kubebuilder:printcolumn:name="Renews",type=string,JSONPath=`.status.renewalTime`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`,priority=1
// +kubebuilder:printcolumn:name="Serial",type=string,JSONPath=`.status.serialNumber`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type ManagedCertificate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   ManagedCertificateSpec   `json:"spec"`
	Status ManagedCertificateStatus `json:"status,omitempty"`
}

// ManagedCertificateList is a list of ManagedCertificates.
//
// +kubebuilder:object:root=true
type ManagedCertificateList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ManagedCertificate `json:"items"`
}

// Issuer is the spec's issuerRef (the zero IssuerRef when it has none).
func (s *ManagedCertificateSpec) Issuer() IssuerRef {
	if s.IssuerRef == nil {
		return IssuerRef{}
	}
	return *s.IssuerRef
}

// Key is the spec's privateKey (the zero PrivateKey when it has none).
func (s *ManagedCertificateSpec) Key() PrivateKey {
	if s.PrivateKey == nil {
		return PrivateKey{}
	}
	return *s.PrivateKey
}
