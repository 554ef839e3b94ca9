// Package v1alpha1 is the certz.pilab.hu/v1alpha1 API of the PiTrust
// Kubernetes operator: the ManagedCertificate resource. The CRD in
// deploy/operator/crd/ is generated from these types by controller-gen
// (make generate-crd); the deepcopy functions too.
//
// +kubebuilder:object:generate=true
// +groupName=certz.pilab.hu
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the API's group and version.
var GroupVersion = schema.GroupVersion{Group: "certz.pilab.hu", Version: "v1alpha1"}

// AddToScheme adds the API's types to a scheme.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &ManagedCertificate{}, &ManagedCertificateList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
